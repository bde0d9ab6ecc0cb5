/* AMX tiles, shared by the kernels that use them (cpu_paged_prefill.c, cpu_gemv.c): whether this
 * build has them, Linux's permission for the tile state, and entering and leaving a tile
 * configuration. Header-only; each kernel library keeps its own permission flag. */
#ifndef YAIED_CPU_AMX_H
#define YAIED_CPU_AMX_H

#include <stdint.h>
#include <string.h>

/* Built where the compiler targets AMX (-march=native on a CPU with it); a kernel uses the tiles
 * only once amx_permitted() said yes. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX_TILES 1

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Linux hands out the tile state on request only (arch_prctl ARCH_REQ_XCOMP_PERM, kernel 5.16
 * on); without it the first tile instruction kills the process. Asked once per library. */
static int amx_permitted(void) {
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    static int answer; /* 0: not asked, 1: yes, -1: no */
    if (!answer)
        answer = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return answer == 1;
}

/* Load a configuration of tiles 0-7, each `rows[t]` rows of `bytes[t]` bytes (at most 64), and
 * return the one the thread had (oneDNN's, say) in `saved`, for tiles_leave to restore. */
static inline void tiles_enter_shaped(TileConfig *saved, const uint8_t rows[8],
                                      const uint16_t bytes[8]) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.colsb[t] = bytes[t], config.rows[t] = rows[t];
    _tile_storeconfig(saved);
    _tile_loadconfig(&config);
}

/* tiles_enter_shaped with every row 64 bytes */
static inline void tiles_enter(TileConfig *saved, const uint8_t rows[8]) {
    static const uint16_t full[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    tiles_enter_shaped(saved, rows, full);
}

static inline void tiles_leave(const TileConfig *saved) {
    if (saved->palette)
        _tile_loadconfig(saved);
    else
        _tile_release();
}
#else
#define HAVE_AMX_TILES 0
#endif

#endif
