// AMX tile state shared by the kernels that use tiles (blocked_rows.cpp: bf16; int8_rows.cpp:
// int8): the tile configuration record and the check that this process may use the tiles.
#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace neffkit_amx {

// LDTILECFG's 64-byte record, palette 1
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// CPUID leaf 7's EDX bits for the tile kinds
constexpr int kBf16Bit = 22, kTileBit = 24, kInt8Bit = 25;

// CPUID says AMX-TILE and the tile kind (`kind_bit`), and Linux grants this process the tile
// state (asked once a process; process-wide, threads included).
inline bool supported(int kind_bit) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> kTileBit) & 1) || !((d >> kind_bit) & 1)) return false;
  static const bool granted = [] {  // only asked where the CPU has tiles
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return granted;
}

}  // namespace neffkit_amx
