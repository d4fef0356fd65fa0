"""tools/kernel_stats.py's SASS opcode count (the compile-only part needs ptxas and runs as a script, not here)."""

import os

import pytest

pytest.importorskip("triton")


def _count_opcodes():
    saved = dict(os.environ)  # the tool drops TRITON_INTERPRET when imported
    try:
        from tools.kernel_stats import count_opcodes
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return count_opcodes


def test_count_opcodes_reads_instructions_and_skips_the_rest():
    sass = """
        code for sm_90
                Function : _prep_kernel
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
                                                                           /* 0x000fe20000000800 */
        /*0010*/               @!P6 FMUL.FTZ R140, R140, 0.5 ;            /* 0x3f0000008c8ce820 */
        /*0020*/                   FMUL R138, R138, 1.4426950216293334961 ;
        /*0030*/                   MUFU.EX2 R149, R140 ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        .L_x_12:
    """
    ops = _count_opcodes()(sass)
    assert ops == {"LDC": 1, "FMUL": 2, "MUFU": 1, "BAR": 1}
