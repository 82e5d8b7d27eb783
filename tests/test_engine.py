"""draftflow.engine: a target vLLM cannot load fails with the engine process's own error."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def broken_target(tmp_path_factory, smollm2_dir: Path) -> Path:
    """The demo target without its final norm's weight: vLLM's loader refuses it."""
    out = tmp_path_factory.mktemp("broken-target")
    for path in smollm2_dir.iterdir():
        if path.suffix != ".safetensors":
            (out / path.name).symlink_to(path.resolve())
    weights = {}
    for path in sorted(smollm2_dir.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    del weights["model.norm.weight"]
    save_file(weights, str(out / "model.safetensors"))
    return out


@pytest.mark.vllm
def test_failed_start_names_the_engines_own_error(broken_target: Path):
    from config_support import demo_engine_settings, make_engine_arguments

    from draftflow.corpus.regenerate import make_engine
    from draftflow.engine import EngineStartError

    engine = demo_engine_settings(
        "regenerate", max_model_len=64, gpu_memory_utilization=0.1, kv_cache_memory_bytes=1 << 24
    )
    with pytest.raises(EngineStartError) as raised:
        make_engine(broken_target, engine, **make_engine_arguments())
    message = str(raised.value)
    print(message)
    assert str(broken_target) in message
    assert "model.norm.weight" in message or "norm" in message, message
    assert "Engine core initialization failed" not in message.split("(the engine's log")[0]


@pytest.mark.vllm
def test_a_bench_engine_that_cannot_start_names_the_cause_in_the_jobs_error(
    broken_target: Path, tmp_path: Path
):
    """The bench's engines run in processes of their own (draftflow.bench.rounds): the job's
    exception carries the engine's own error, not only an exit code."""
    from config_support import demo_bench_settings

    from draftflow.bench.run import engine_request, run_engines

    request = engine_request(
        str(broken_target),
        None,
        [0],
        {"set": [{"id": "a", "turns": ["Hello"]}]},
        demo_bench_settings(
            max_tokens=4,
            engine={"max_model_len": 64, "max_num_seqs": 1, "kv_cache_memory_bytes": 1 << 24},
        ),
    )
    with pytest.raises(RuntimeError) as raised:
        run_engines(request, {0: tmp_path / "k0.json"})
    message = str(raised.value)
    print(message)
    assert message.startswith("benchmark engine k=0 failed (exit code 1): EngineStartError:")
    assert str(broken_target) in message and "norm" in message, message
    assert not (tmp_path / "k0.json").exists()


@pytest.mark.vllm
def test_an_engine_that_dies_mid_call_names_the_workers_own_error(smollm2_dir: Path):
    """A failure inside a running engine (here the capture worker cannot open its request file:
    its directory is gone) reaches the driver as vLLM's "see above"; the backend's error names
    the worker's exception instead."""
    import shutil

    from config_support import capture_engine_settings, demo_capture_layers

    from draftflow.capture.backends import make_backend
    from draftflow.engine import EngineRunError

    layers = demo_capture_layers(smollm2_dir)
    settings = capture_engine_settings(
        64,
        max_num_batched_tokens=1024,
        max_num_seqs=2,
        kv_cache_memory_bytes=1 << 24,
        reserved_cpus=None,
        deterministic=False,
    )
    backend = make_backend("hooks", smollm2_dir, layers.layer_ids, settings)
    try:
        shutil.rmtree(backend._tmp.name)
        with pytest.raises(EngineRunError) as raised:
            backend.capture([[1, 2, 3, 4]])
    finally:
        backend.close()
    message = str(raised.value)
    print(message)
    assert message.startswith("the vLLM engine failed: FileNotFoundError:"), message
    assert backend._tmp.name in message


@pytest.mark.parametrize(
    ("kwargs", "cpu", "native_bf16", "expected"),
    [
        ({}, True, False, "float32"),
        ({"dtype": "auto"}, True, False, "float32"),
        ({"dtype": "bfloat16"}, True, False, None),  # asked for: kept
        ({}, True, True, None),
        ({}, False, False, None),
    ],
)
def test_platform_dtype(kwargs, cpu, native_bf16, expected):
    from draftflow.engine import platform_dtype

    assert platform_dtype(kwargs, cpu, native_bf16) == expected


@pytest.mark.vllm
def test_an_engine_left_to_choose_its_dtype_runs_float32_on_a_cpu_without_bf16(smollm2_dir: Path):
    """The prepared target is a bf16 checkpoint: vLLM would run it in bf16, which a CPU without
    native bf16 emulates (7x slower prefill); start_engine runs it in float32 there."""
    import torch
    from config_support import demo_engine_env, demo_engine_kwargs

    from draftflow.engine import shutdown_engine, start_engine
    from draftflow.hardware import cpu_has_native_bf16

    cache = {"kv_cache_memory_bytes": 1 << 24}
    kwargs = demo_engine_kwargs(smollm2_dir, max_model_len=64, **cache)
    llm = start_engine(kwargs, demo_engine_env("regenerate", reserved_cpus=1, **cache))
    try:
        dtype = llm.llm_engine.model_config.dtype
    finally:
        shutdown_engine(llm)
    assert dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
