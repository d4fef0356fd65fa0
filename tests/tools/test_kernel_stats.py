"""tools/kernel_stats.py's SASS opcode count and its argument checks (the compile-only part needs ptxas: it runs in
tests/ops/kda/test_build_sm90.py)."""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _tool():
    saved = dict(os.environ)  # the tool drops TRITON_INTERPRET when imported
    try:
        import tools.kernel_stats as tool
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return tool


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
    ops = _tool().count_opcodes(sass)
    assert ops == {"LDC": 1, "FMUL": 2, "MUFU": 1, "BAR": 1}


def test_global_accesses_by_width():
    sass = """
        /*0100*/                   LDG.E.U16 R4, desc[UR6][R2.64] ;       /* 0x0000000602047981 */
        /*0110*/               @!P1 LDG.E.U16 R5, desc[UR6][R2.64+0x2] ;
        /*0120*/                   LDG.E.128 R8, desc[UR6][R6.64] ;
        /*0130*/                   STG.E.128 desc[UR6][R10.64], R12 ;
        /*0140*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR6][R4.64] ;
        /*0150*/                   LDS.128 R16, [R3] ;
    """
    accesses = _tool().global_accesses(sass)
    assert accesses == {"LDG.E.U16": 2, "LDG.E.128": 1, "STG.E.128": 1}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--attnres", "0"], "--attnres: expected a width D in 1 .. 16384"),
        (["--attnres", "64", "--softplus", "--forward-only"], "--attnres takes --dtype and --sass only, got "
         "--softplus, --forward-only"),
        (["--no-gate", "--softplus"], "not allowed with argument"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_before_any_compile(args, message):
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, str(root / "tools" / "kernel_stats.py"), *args], capture_output=True,
                         text=True, env=env, timeout=120)  # fmt: skip
    assert run.returncode == 2 and message in run.stderr, run.stderr
