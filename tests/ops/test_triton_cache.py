"""Cold-start helpers of the Triton kernels (hybrid_attention/ops/triton_cache.py): the compile notice, its hooks,
and the on-disk autotuning option. The end-to-end check (two processes, a real compile) is tests/gpu/."""

from __future__ import annotations

import inspect
import time
from types import SimpleNamespace

import pytest

triton = pytest.importorskip("triton")

from hybrid_attention.ops import triton_cache  # noqa: E402
from hybrid_attention.ops.triton_cache import AUTOTUNE_OPTIONS, CompileNotice, announce_compilation  # noqa: E402


def _wait_for(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while not predicate() and time.monotonic() < end:
        time.sleep(0.01)
    return predicate()


def test_long_compilations_are_announced_once_per_kernel():
    lines = []
    notice = CompileNotice(lines.append, after_s=0.05, cache_dir="/cache")
    notice.start("fast_kernel")
    notice.end("fast_kernel")  # a load from the disk cache: nothing to say
    notice.start("slow_kernel")
    assert _wait_for(lambda: len(lines) == 1)  # said while the compilation is still running
    notice.end("slow_kernel")
    assert lines[0].startswith("compiling Triton kernel slow_kernel ...") and "/cache" in lines[0]
    notice.start("slow_kernel")  # another specialisation of the same kernel
    time.sleep(0.2)
    notice.end("slow_kernel")
    notice.start("other_kernel")
    assert _wait_for(lambda: len(lines) == 2)
    notice.end("other_kernel")
    time.sleep(0.2)
    assert lines[1] == "compiling Triton kernel other_kernel ..."  # the cache note only once
    assert notice.announced == {"slow_kernel", "other_kernel"}


def test_hooks_chain_with_existing_ones(monkeypatch):
    runtime = triton.knobs.runtime
    calls = []
    monkeypatch.setattr(triton_cache, "_installed", None)
    monkeypatch.setattr(runtime, "jit_cache_hook", lambda **kw: calls.append(("before", kw["fn"].name)) or False)
    monkeypatch.setattr(runtime, "jit_post_compile_hook", lambda **kw: calls.append(("after", kw["fn"].name)))
    lines = []
    notice = announce_compilation(lines.append)
    assert announce_compilation(print) is notice and notice.echo is print  # installed once
    notice.after_s = 0.05
    notice.echo = lines.append
    fn = SimpleNamespace(name="k")
    assert not runtime.jit_cache_hook(key=None, repr="", fn=fn, compile={}, is_manual_warmup=False)
    assert _wait_for(lambda: lines)
    runtime.jit_post_compile_hook(key=None, repr="", fn=fn, compile={}, is_manual_warmup=False)
    assert calls == [("before", "k"), ("after", "k")] and lines[0].startswith("compiling Triton kernel k ...")


def test_an_earlier_hook_that_skips_compilation_is_respected(monkeypatch):
    runtime = triton.knobs.runtime
    monkeypatch.setattr(triton_cache, "_installed", None)
    monkeypatch.setattr(runtime, "jit_cache_hook", lambda **kw: True)
    monkeypatch.setattr(runtime, "jit_post_compile_hook", None)
    notice = announce_compilation(lambda line: None)
    assert runtime.jit_cache_hook(fn=SimpleNamespace(name="k")) is True and not notice._timers


def test_autotuned_kernels_keep_their_choices_on_disk(monkeypatch):
    assert "cache_results" in inspect.signature(triton.autotune).parameters  # Triton >= 3.3, as pyproject requires
    assert AUTOTUNE_OPTIONS == {"cache_results": True}
    from hybrid_attention.ops.triton_support import autotune

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a compiled-mode tuner (built, never launched here)

    def kernel(x, N: triton.language.constexpr):
        pass

    tuner = autotune([{}, {}], [(4, 1), (8, 1)], ["N"])(triton.jit(kernel))
    assert tuner.cache_results is True and len(tuner.configs) == 2


def _fake_tuner(name, n=3):
    configs = [f"{name}-config-{i}" for i in range(n)]
    return SimpleNamespace(configs=list(configs), all_configs=configs, fn=SimpleNamespace(__name__=name))


def test_first_configs_only_reaches_every_tuner_and_restores_them(monkeypatch):
    monkeypatch.setattr(triton_cache, "TUNERS", [])
    a, b = triton_cache.register_tuner(_fake_tuner("a")), triton_cache.register_tuner(_fake_tuner("b", 2))
    before = [list(t.configs) for t in (a, b)]
    with triton_cache.first_configs_only():
        assert a.configs == ["a-config-0"] and b.configs == ["b-config-0"]
        late = triton_cache.register_tuner(_fake_tuner("late"))  # a module imported inside the block
        assert late.configs == ["late-config-0"]
        with triton_cache.first_configs_only():  # nested: still the first configs, and restored to them
            assert a.configs == ["a-config-0"]
        assert a.configs == ["a-config-0"] and late.configs == ["late-config-0"]
    assert [a.configs, b.configs] == before and late.configs == late.all_configs
    after = triton_cache.register_tuner(_fake_tuner("after"))  # outside any block: untouched
    assert after.configs == after.all_configs
    with pytest.raises(ValueError, match="needs an all_configs list"):
        triton_cache.register_tuner(SimpleNamespace(configs=[], fn=SimpleNamespace(__name__="bare")))


def test_the_package_registers_its_kda_attnres_and_gemv_tuners():
    from hybrid_attention.ops import gemv
    from hybrid_attention.ops.attnres import triton_mix_norm, triton_stream_bwd
    from hybrid_attention.ops.kda.kernels import prep

    for tuner in (
        prep._prep_kernel,
        triton_mix_norm._full_fwd_kernel,
        triton_stream_bwd._stream_bwd_kernel,
        gemv._gemv_kernel,
    ):
        assert tuner in triton_cache.TUNERS, tuner.fn.__name__
