// The program the command line's precompiled headers are built with (cmake/pch.cmake).
int main() { return 0; }
