// How the moed program's commands find each other: each command file registers a setup
// function under a parent ("" = top level, "bench" = under `moed bench`), so adding a command
// never edits main.cc.
//
//   static void setup(CLI::App& bench) { auto* c = bench.add_subcommand("permute", "..."); ... }
//   MOED_CLI_COMMAND("bench", setup);
//
// A command reports failure by throwing CLI::RuntimeError(exit_code) after printing a message
// naming the problem; usage errors are CLI11's own (exit code 106 and the usage text).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdio>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace moed::cli {

using Setup = std::function<void(CLI::App& parent)>;

struct Registration {
  std::string parent;
  Setup setup;
};
std::vector<Registration>& registrations();

// How every command fails: "<command>: <message>" on stderr, then exit code 1.
[[noreturn]] inline void fail_command(std::string_view command, const std::string& message) {
  std::fprintf(stderr, "%.*s: %s\n", int(command.size()), command.data(), message.c_str());
  throw CLI::RuntimeError(1);
}

struct Registrar {
  Registrar(const char* parent, Setup setup) {
    registrations().push_back(Registration{parent, std::move(setup)});
  }
};

}  // namespace moed::cli

#define MOED_CLI_CONCAT_INNER(a, b) a##b
#define MOED_CLI_CONCAT(a, b) MOED_CLI_CONCAT_INNER(a, b)
#define MOED_CLI_COMMAND(parent, fn) \
  static ::moed::cli::Registrar MOED_CLI_CONCAT(moed_cli_registrar_, __COUNTER__)(parent, fn)
