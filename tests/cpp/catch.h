// Catch2 v2 (Debian 12) and v3 (Debian 13) spell their headers differently; every test
// includes this one file and uses only the macros both versions share.
#pragma once
#if __has_include(<catch2/catch_test_macros.hpp>)
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#else
#include <catch2/catch.hpp>
#endif
