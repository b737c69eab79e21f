// The translation unit the precompiled headers are built with (cmake/pch.cmake); nothing else.
