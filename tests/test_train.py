"""Draft training on a tiny capture store made from the real SmolLM2 target (CPU).

The store is written with the capture stage's ``CaptureWriter`` from transformers' hidden states of
greedy target continuations, so the draft learns the target's own distribution and its training
prompts make a fair over-fitting check in vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from capture_stores import StoreShape, open_writer
from config_support import demo_bench_settings, demo_config, train_settings
from safetensors.torch import load_file

from draftflow.config import from_section
from draftflow.io import DiskFullError, sha256_file
from draftflow.train.checkpoint import latest_checkpoint
from draftflow.train.job import TrainJob
from draftflow.train.loop import train
from draftflow.train.metrics import read_metrics
from draftflow.train.settings import TrainSettings
from draftflow.train.vocab import write_vocab

REPO = Path(__file__).resolve().parents[1]

TRAIN_PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Give me three tips for learning Python.",
    "Explain photosynthesis in one sentence.",
    "List the first five prime numbers.",
    "Why is the sky blue?",
    "How do I boil an egg?",
    "Suggest a name for a pet dog.",
    "What is the boiling point of water?",
    "Tell me a fun fact about octopuses.",
    "How do airplanes stay in the air?",
    "Write a short poem about autumn.",
    "What is a prime number?",
    "Give me a recipe for pancakes.",
    "Who wrote Romeo and Juliet?",
    "Explain gravity to a child.",
    "What are the planets of the solar system?",
    "How can I improve my handwriting?",
    "Describe the water cycle.",
    "What is the difference between a virus and a bacterium?",
    "Translate 'good morning' into Spanish.",
    "Why do we need sleep?",
    "Give me an idea for a birthday party.",
    "What is machine learning?",
]
VAL_PROMPTS = [
    "What is the largest planet?",
    "Give me a tip for sleeping well.",
    "Explain what a noun is.",
    "How do bees make honey?",
]
NEW_TOKENS = 32
DRAFT_VOCAB = 1024
# Two helpers' processes share two cores here: more than one torch thread each thrashes.
THREADS = 1


def _chat_prompts(tokenizer, prompts: list[str]) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]


def _greedy_continuations(model, tokenizer, texts: list[str]) -> list[tuple[torch.Tensor, int]]:
    """(prompt + greedy continuation ids, prompt length) per prompt; one batched generate call."""
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    results = []
    for row, attention in zip(out, batch.attention_mask, strict=True):
        pad = int((attention == 0).sum())
        prompt_len = int(attention.sum())
        ids = row[pad:]
        # Cut the padding after an early end of turn.
        if tokenizer.pad_token_id is not None:
            keep = prompt_len + int((ids[prompt_len:] != tokenizer.pad_token_id).cumprod(0).sum())
            ids = ids[: max(keep, prompt_len + 1)]
        results.append((ids, prompt_len))
    return results


def _capture(model, tokenizer, prompts: list[str], out_dirs: list[Path], layer_ids, aux_ids):
    """Greedy continuations of the target, then its hidden states, into len(out_dirs) shards."""
    hidden_size = model.config.hidden_size
    shape = StoreShape(layer_ids, aux_ids, hidden_size)
    writers = [open_writer(d, shape, {"backend": "test-hf"}) for d in out_dirs]
    freq = torch.zeros(model.config.vocab_size, dtype=torch.int64)
    final_pre_norm: list[torch.Tensor] = []
    # transformers' hidden_states[L] is after the final norm: take its input instead.
    hook = model.model.norm.register_forward_pre_hook(
        lambda _module, args: final_pre_norm.append(args[0])
    )
    try:
        sequences = _greedy_continuations(model, tokenizer, _chat_prompts(tokenizer, prompts))
        for n, (ids, prompt_len) in enumerate(sequences):
            with torch.no_grad():
                final_pre_norm.clear()
                out = model(ids.unsqueeze(0), output_hidden_states=True)
            states = [out.hidden_states[i][0] for i in aux_ids] + [final_pre_norm[-1][0]]
            mask = torch.zeros(ids.shape[0], dtype=torch.int8)
            mask[prompt_len:] = 1
            freq += torch.bincount(ids[mask.bool()], minlength=model.config.vocab_size)
            writers[n % len(writers)].add(
                f"s{n}", ids.to(torch.int32), mask, torch.stack(states, dim=1)
            )
    finally:
        hook.remove()
    for writer in writers:
        writer.close()
    return freq


@pytest.fixture(scope="module")
def tiny_store(smollm2_dir, tmp_path_factory):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    root = tmp_path_factory.mktemp("store")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    # bf16 like the vLLM engine, so its greedy continuations are the ones trained on.
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    num_layers = model.config.num_hidden_layers
    aux_ids = [2, num_layers // 2, num_layers - 3]
    layer_ids = [*aux_ids, num_layers]
    train_dirs = [root / "train" / f"shard-{i:05d}" for i in range(2)]
    val_dirs = [root / "val" / "shard-00000"]
    freq = _capture(model, tokenizer, TRAIN_PROMPTS, train_dirs, layer_ids, aux_ids)
    _capture(model, tokenizer, VAL_PROMPTS, val_dirs, layer_ids, aux_ids)
    save_file({"token_freq": freq}, str(root / "token_freq.safetensors"))
    write_vocab(
        root / "token_freq.safetensors",
        root / "vocab.safetensors",
        root / "vocab.json",
        DRAFT_VOCAB,
    )
    return {
        "root": root,
        "target": str(smollm2_dir),
        "train": [str(d) for d in train_dirs],
        "val": [str(d) for d in val_dirs],
        "vocab": str(root / "vocab.safetensors"),
        "prompts": _chat_prompts(tokenizer, TRAIN_PROMPTS),
    }


def _job(store, out: Path, **settings) -> TrainJob:
    # The demo's train settings (config/demo.yaml) but for these.
    base = {
        "epochs": 1,
        "optimizer": "adamw",
        "tokens_per_batch": 128,
        "lr": 1e-3,
        "warmup_steps": 10,
        "eval_every": 50,
        "checkpoint_every": 50,
        "log_every": 25,
        "threads": THREADS,
    }
    base.update(settings)
    return TrainJob(
        target_dir=store["target"],
        vocab_path=store["vocab"],
        train_shards=store["train"],
        val_shards=store["val"],
        draft_dir=str(out / "draft"),
        metrics_path=str(out / "metrics.jsonl"),
        checkpoint_dir=str(out / "checkpoints"),
        settings=train_settings(**base),
        trust_remote_code=demo_config()["target"]["trust_remote_code"],
    )


@pytest.fixture(scope="module")
def trained(tiny_store, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    job = _job(tiny_store, out, epochs=16)
    summary = train(job)
    return {"job": job, "out": out, "summary": summary}


def test_val_loss_falls_and_accuracy_rises(trained):
    records = read_metrics(trained["out"] / "metrics.jsonl")
    val = [r for r in records if r["kind"] == "val"]
    steps = [r for r in records if r["kind"] == "train"]
    assert val[0]["step"] == 0 and val[-1]["step"] == trained["summary"]["steps"] >= 200
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    # Held-out prompts: 24 training samples generalise only so far, but clearly.
    assert val[-1]["loss"] < 0.6 * val[0]["loss"]
    assert val[-1]["full_acc"][0] > val[0]["full_acc"][0] + 0.1
    assert all(
        end >= start for start, end in zip(val[0]["full_acc"], val[-1]["full_acc"], strict=True)
    )
    # Training batches: every draft position is learned (all of tokens 1..k right).
    first, last = steps[0], steps[-10:]
    for k in range(3):
        late = sum(r["full_acc"][k] for r in last) / len(last)
        assert late > 0.5 and late > first["full_acc"][k] + 0.4, (k, late)
        cond = sum(r["cond_acc"][k] for r in last) / len(last)
        assert cond > 0.7, (k, cond)
    assert all(r["tokens_per_s"] > 0 and r["tokens"] > 0 for r in steps)


def test_export_is_a_speculators_checkpoint(trained):
    draft = Path(trained["job"].draft_dir)
    config = json.loads((draft / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == trained["job"].target_dir
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    weights = load_file(str(draft / "model.safetensors"))
    assert weights["d2t"].shape == (DRAFT_VOCAB,)
    assert all(v.dtype == torch.bfloat16 for k, v in weights.items() if k not in ("d2t", "t2d"))
    assert not any(k.startswith("verifier_") for k in weights)
    assert "val loss" in (draft / "README.md").read_text()


def _run_cli(job: TrainJob, job_path: Path) -> subprocess.Popen:
    job_path.write_text(job.to_json())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "draftflow.train.cli", str(job_path)],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )


# Wall-clock fields of the metrics log: the only ones two runs of one job may differ in.
TIMING_KEYS = {"tokens_per_s"}


def _untimed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])  # muon: the demo's since 2026-12-04
def test_killed_run_resumes_bit_identical(tiny_store, tmp_path, optimizer):
    settings = {"max_steps": 12, "checkpoint_every": 4, "eval_every": 6, "optimizer": optimizer}
    straight = _job(tiny_store, tmp_path / "straight", **settings)
    train(straight)

    # Two runs from scratch: the same weights and metrics to the bit, and the export says so.
    again = _job(tiny_store, tmp_path / "again", **settings)
    train(again)
    first, second = (Path(j.draft_dir) for j in (straight, again))
    sums = [json.loads((d / "draftflow_train.json").read_text())["files"] for d in (first, second)]
    assert sums[0] == sums[1] and {"config.json", "model.safetensors"} <= set(sums[0])
    assert sums[0]["model.safetensors"] == sha256_file(first / "model.safetensors")
    records = [read_metrics(j.metrics_path) for j in (straight, again)]
    assert _untimed(records[0]) == _untimed(records[1])
    assert any(r["kind"] == "val" and r["step"] == 6 for r in records[0])

    resumed = _job(tiny_store, tmp_path / "resumed", **settings)
    process = _run_cli(resumed, tmp_path / "job.json")
    # Kill the job (SIGKILL: no clean-up) once its second checkpoint is on disk.
    while process.poll() is None:
        found = latest_checkpoint(resumed.checkpoint_dir)
        if found is not None and found.name >= "step-00000008":
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the job ended before it could be killed"
    assert not (Path(resumed.draft_dir) / "model.safetensors").exists()

    train(resumed)
    a = load_file(str(Path(straight.draft_dir) / "model.safetensors"))
    b = load_file(str(Path(resumed.draft_dir) / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # The metrics log reads as one run: every step once.
    steps = [r["step"] for r in read_metrics(resumed.metrics_path) if r["kind"] == "train"]
    assert steps == list(range(1, len(steps) + 1))


def _delete_outputs_as_snakemake_does(job: TrainJob) -> None:
    """What Snakemake does before it reruns rule train: its declared outputs go, checkpoints stay."""
    Path(job.metrics_path).unlink(missing_ok=True)
    shutil.rmtree(job.draft_dir, ignore_errors=True)


@pytest.mark.parametrize("kill_after", ["step-00000004", "step-00000008"])
def test_metrics_survive_a_kill_after_the_first_checkpoint(tiny_store, tmp_path, kill_after):
    """Issue 39: killed after a checkpoint, its outputs deleted, the job keeps its whole curve."""
    settings = {"max_steps": 12, "checkpoint_every": 4, "eval_every": 3}
    straight = _job(tiny_store, tmp_path / "straight", **settings)
    train(straight)
    want = read_metrics(straight.metrics_path)
    assert [r["step"] for r in want if r["kind"] == "val"] == [0, 3, 6, 9, 12]

    killed = _job(tiny_store, tmp_path / "killed", **settings)
    process = _run_cli(killed, tmp_path / "job.json")
    while process.poll() is None:  # SIGKILL once the checkpoint is on disk
        found = latest_checkpoint(killed.checkpoint_dir)
        if found is not None and found.name >= kill_after:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the job ended before it could be killed"
    resumed_from = int(latest_checkpoint(killed.checkpoint_dir).name.removeprefix("step-"))
    assert int(kill_after.removeprefix("step-")) <= resumed_from < 12
    _delete_outputs_as_snakemake_does(killed)

    train(killed)
    got = read_metrics(killed.metrics_path)
    # The same records in the same order, bit-identical but for the wall-clock field.
    assert _untimed(got) == _untimed(want)
    assert [r["step"] for r in got if r["kind"] == "val"] == [0, 3, 6, 9, 12]


def test_forced_rerun_of_a_finished_job_trains_from_scratch(tiny_store, tmp_path, caplog):
    """Issue 39: a rerun of a finished job (--forcerun, which deletes its outputs too) does not
    resume from the checkpoints the finished run left; it equals a fresh run."""
    settings = {"max_steps": 12, "checkpoint_every": 4, "eval_every": 6}
    fresh = _job(tiny_store, tmp_path / "fresh", **settings)
    train(fresh)
    job = _job(tiny_store, tmp_path / "forced", **settings)
    train(job)
    assert latest_checkpoint(job.checkpoint_dir).name == "step-00000008"
    assert (Path(job.checkpoint_dir) / "COMPLETE").is_file()

    _delete_outputs_as_snakemake_does(job)
    with caplog.at_level("WARNING", logger="draftflow.train.checkpoint"):
        train(job)
    assert "previous run of this job finished" in caplog.text
    assert _untimed(read_metrics(job.metrics_path)) == _untimed(read_metrics(fresh.metrics_path))
    assert sha256_file(Path(job.draft_dir) / "model.safetensors") == sha256_file(
        Path(fresh.draft_dir) / "model.safetensors"
    )
    assert (Path(job.checkpoint_dir) / "COMPLETE").is_file()


def test_train_on_a_disk_that_fills_keeps_its_checkpoint_and_resumes_to_the_same_bytes(
    tiny_store, tmp_path, small_filesystem
):
    settings = {"max_steps": 12, "checkpoint_every": 4, "eval_every": 6}
    reference = _job(tiny_store, tmp_path / "reference", **settings)
    train(reference)
    checkpoint = latest_checkpoint(reference.checkpoint_dir)
    checkpoint_bytes = sum(p.stat().st_size for p in checkpoint.iterdir())

    # Room for the first checkpoint, not for the second beside it.
    disk = small_filesystem(checkpoint_bytes * 8 // 5)
    job = _job(tiny_store, disk, **settings)
    with pytest.raises(DiskFullError) as full:
        train(job)
    message = str(full.value)
    assert f"checkpoints/step-00000008 ({disk})" in message
    assert "it needs" in message and "rerun" in message
    # Nothing partial: the first checkpoint whole, no staging directory, no draft.
    assert latest_checkpoint(job.checkpoint_dir).name == "step-00000004"
    assert sorted(p.name for p in Path(job.checkpoint_dir).iterdir()) == [
        "latest.json",
        "metrics.jsonl",  # the metrics history (a resumed job rebuilds metrics.jsonl from it)
        "step-00000004",
    ]
    assert not Path(job.draft_dir).exists()

    # Space freed: the rerun resumes from step 4 and ends where the uninterrupted run did.
    small_filesystem.resize(disk, checkpoint_bytes * 6)
    train(job)
    assert sha256_file(Path(job.draft_dir) / "model.safetensors") == sha256_file(
        Path(reference.draft_dir) / "model.safetensors"
    )
    assert _untimed(read_metrics(job.metrics_path)) == _untimed(
        read_metrics(reference.metrics_path)
    )


@pytest.mark.vllm
def test_trained_draft_is_accepted_in_vllm(trained, tiny_store, tmp_path):
    """The bench stage's engine, greedy, on the prompts the draft was trained on: its tokens
    are accepted. The control, a randomly initialised draft whose tokens are not (τ < 1.3), is
    tests/test_bench.py::test_a_random_draft_is_not_accepted, on the bench's random draft."""
    from draftflow.bench.run import engine_request, run_engines

    prompt_set = [{"id": f"p{i}", "turns": [text]} for i, text in enumerate(TRAIN_PROMPTS[:8])]
    engine = {
        "max_model_len": 1024,
        "max_num_seqs": 8,
        "kv_cache_memory_bytes": 128 << 20,
        "dtype": "bfloat16",
        "reserved_cpus": 1,
    }
    request = engine_request(
        tiny_store["target"],
        trained["job"].draft_dir,
        [3],
        {"train": prompt_set},
        demo_bench_settings(max_tokens=48, tie_margin=0.0, engine=engine),
    )
    (run,) = run_engines(request, {3: tmp_path / "trained.json"})[3]["runs"]
    assert run["num_drafts"] > 0
    tau = 1 + run["num_accepted_tokens"] / run["num_drafts"]
    print("acceptance length", tau)
    assert tau > 1.6, tau
    texts = [r["text"] for turns in run["responses"].values() for r in turns]
    assert texts and all(texts)


def test_data_parallel_over_two_ranks(trained, tiny_store, tmp_path):
    """The torchrun path (gloo on the CPU; NCCL on GPUs): one batch per rank per step."""
    from draftflow.train.captures import CaptureSet, TrainPlan
    from draftflow.train.cli import launch

    job = _job(tiny_store, tmp_path, max_steps=4, device="cpu", eval_every=4, checkpoint_every=2)
    launch(job, 2)
    assert (Path(job.draft_dir) / "model.safetensors").is_file()
    records = read_metrics(job.metrics_path)
    steps = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    s = job.settings  # the plan the two ranks trained on
    plan = TrainPlan(
        CaptureSet(job.train_shards), s.tokens_per_batch, s.epochs, s.seed, 2, s.max_steps, s.order
    )
    for step, record in enumerate(steps):
        both = [min(128, sum(r.num_tokens - 1 for r in plan.batch(step, rank))) for rank in (0, 1)]
        assert record["tokens"] == sum(both)
    # Validation covers every val position exactly once, as in a single process.
    single = read_metrics(trained["out"] / "metrics.jsonl")[0]
    assert [r["positions"] for r in records if r["kind"] == "val"] == [single["positions"]] * 2


@pytest.mark.workflow
def test_vocab_and_train_rules_through_snakemake(tiny_store, tmp_path):
    """rules vocab and train through snakemake on finished upstream files (only they may run)."""
    import shutil

    import yaml

    work = tmp_path / "work"
    (work / "resources").mkdir(parents=True)
    (work / "resources" / "target").symlink_to(tiny_store["target"])
    (work / "results" / "tokenize").mkdir(parents=True)
    shutil.copy(tiny_store["root"] / "token_freq.safetensors", work / "results" / "tokenize")
    for split in ("train", "val"):
        for shard in tiny_store[split]:
            shutil.copytree(shard, work / "results" / "extract" / split / Path(shard).name)
    config = demo_config()
    config["vocab"]["draft_vocab_size"] = DRAFT_VOCAB
    config["train"].update(
        max_steps=8, tokens_per_batch=128, eval_every=4, checkpoint_every=4, threads=THREADS
    )
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    command = [
        str(Path(sys.executable).parent / "snakemake"),
        "--snakefile",
        str(REPO / "Snakefile"),
        "--configfile",
        str(work / "config.yaml"),
        "--cores",
        "2",
        "--allowed-rules",
        "vocab",
        "train",
        "--",
        "results/train/draft",
    ]
    run = subprocess.run(command, cwd=work, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((work / "results" / "vocab" / "summary.json").read_text())
    assert summary["draft_vocab_size"] == DRAFT_VOCAB and summary["coverage"] == 1.0
    draft = work / "results" / "train" / "draft"
    assert json.loads((draft / "config.json").read_text())["speculators_model_type"] == "eagle3"
    records = read_metrics(work / "results" / "train" / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "val"] == [0, 4, 8]
    assert (work / "results" / "train" / "checkpoints" / "latest.json").is_file()
    assert "train done" in (work / "logs" / "train.log").read_text()

    # --forcerun train (Snakemake deletes the outputs, the checkpoints stay): the job trains
    # from scratch, not from the finished run's last checkpoint, and ends where it did.
    forced = subprocess.run(
        [*command[:-2], "--forcerun", "train", *command[-2:]],
        cwd=work,
        capture_output=True,
        text=True,
        check=False,
    )
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "previous run of this job finished" in (work / "logs" / "train.log").read_text()
    again = read_metrics(work / "results" / "train" / "metrics.jsonl")
    assert _untimed(again) == _untimed(records)

    # A capture chunk changed after its extract job finished: training from scratch refuses it
    # and names the file (the chunk's sha256 no longer matches its shard's manifest).
    chunk = work / "results" / "extract" / "train" / "shard-00000" / "chunk-00000.safetensors"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    shutil.rmtree(work / "results" / "train")
    rerun = subprocess.run(command, cwd=work, capture_output=True, text=True, check=False)
    assert rerun.returncode != 0, "training accepted a corrupt capture chunk"
    log = (work / "logs" / "train.log").read_text()
    assert f"{chunk.relative_to(work)} is corrupt: sha256" in log, log[-3000:]
    assert not (work / "results" / "train" / "draft").exists()


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"loss": "kl"}, r"train.loss 'kl': Unknown loss function 'kl'"),
        ({"optimizer": "sgd"}, r"train.optimizer 'sgd' is not one of \('adamw', 'muon'\)"),
        ({"ttt_steps": 0}, r"train.ttt_steps must be >= 1, got 0"),
        ({"epoch": 3}, r"unknown train settings \['epoch'\]"),
    ],
)
def test_bad_train_settings_are_named(section, message):
    with pytest.raises(ValueError, match=message):
        from_section(TrainSettings, {**demo_config()["train"], **section}, "train")


def test_packed_attention_trains_as_dense_attention(tiny_store, tmp_path):
    """The CPU's default draft attention (``auto``: SDPA one packed sample at a time) against
    SDPA over the whole packed step: the same losses and accuracies step by step, within
    float32 rounding, on steps that pack several samples."""
    from draftflow.train.attention import PACKED_SDPA
    from draftflow.train.model import resolve_attn_impl

    assert resolve_attn_impl("auto", torch.device("cpu")) == PACKED_SDPA
    settings = {"max_steps": 4, "tokens_per_batch": 512, "log_every": 1, "eval_every": 4}
    runs = {}
    for attention in ("auto", "sdpa"):
        job = _job(tiny_store, tmp_path / attention, attn_impl=attention, **settings)
        train(job)
        runs[attention] = [r for r in read_metrics(job.metrics_path) if r["kind"] == "train"]
    packed, dense = runs["auto"], runs["sdpa"]
    assert [r["step"] for r in packed] == [r["step"] for r in dense] == list(range(1, 5))
    # Step 1 is the same weights through both attentions: float32 rounding only. Later steps
    # add AdamW's early updates, about lr in size whatever the gradient, so a rounding-sized
    # gradient difference moves a weight by up to lr: measured 2e-4 relative by step 4.
    assert packed[0]["loss"] == pytest.approx(dense[0]["loss"], rel=2e-5)
    for a, b in zip(packed, dense, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
        assert a["full_acc"] == pytest.approx(b["full_acc"], abs=1e-6)


def test_eagle3_1_trains_and_exports_one_norm_per_aux_layer(tiny_store, tmp_path):
    """train.variant eagle3.1: speculators' fc_norm (one RMSNorm per aux layer, EAGLE 3.1)
    instead of one over the concatenation; the norms learn and the export names them as
    vLLM's Eagle3 Llama loads them (tests/test_bench.py runs such a draft in vLLM)."""
    # The export is bf16 (a step of 2**-8 near 1.0): the lr is high enough, and the warmup short
    # enough, that six AdamW steps move each norm past it.
    job = _job(
        tiny_store,
        tmp_path,
        variant="eagle3.1",
        max_steps=6,
        lr=3e-3,
        warmup_steps=2,
        log_every=1,
        eval_every=6,
    )
    train(job)
    config = json.loads((Path(job.draft_dir) / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_before_fc"] is False
    weights = load_file(str(Path(job.draft_dir) / "model.safetensors"))
    norms = [weights[f"fc_norm.{i}.weight"] for i in range(3)]
    assert "norm_before_fc.weight" not in weights
    assert all(not torch.equal(norm, torch.ones_like(norm)) for norm in norms)
    records = [r for r in read_metrics(job.metrics_path) if r["kind"] == "train"]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert records[-1]["loss"] < records[0]["loss"]


def test_sync_free_accuracy_counts_match_speculators():
    # draftflow.train.model._accuracy_counts replaces speculators' masked_select version (a GPU
    # wait per TTT step); it must give the same four counts and update prev_correct the same way.
    from speculators.models.metrics import compute_accuracy_single_step

    from draftflow.train.model import _accuracy_counts

    generator = torch.Generator().manual_seed(0)
    for trial in range(50):
        length = int(torch.randint(1, 64, (1,), generator=generator))
        pred = torch.randint(0, 4, (1, length), generator=generator)
        target = torch.randint(0, 4, (1, length), generator=generator)
        mask = torch.randint(0, 2, (1, length), generator=generator).bool() if trial % 3 else None
        prev = torch.randint(0, 2, (1, length), generator=generator).bool() if trial % 2 else None
        prev_ours = None if prev is None else prev.clone()
        prev_theirs = None if prev is None else prev.clone()
        ours = _accuracy_counts(pred, target, mask, prev_ours)
        theirs = compute_accuracy_single_step(pred, target, mask, prev_theirs)
        assert [float(x) for x in ours] == [float(x) for x in theirs]
        if prev is not None:
            assert torch.equal(prev_ours, prev_theirs)


def test_muon_orthogonalizes_in_float32_as_torch_does_in_bf16():
    """The float32 iteration that CPUs without native bf16 run gives torch's Muon update to
    within bf16's precision, in the gradient's shape."""
    import torch
    from torch.optim._muon import DEFAULT_NS_STEPS

    # torch's own, even where an earlier test's CPU Muon replaced it in torch's module
    from draftflow.train.optim import TORCH_ORTHOGONALIZE, orthogonalize_fp32

    coefficients = (3.4445, -4.7750, 2.0315)
    generator = torch.Generator().manual_seed(0)
    for shape in ((96, 32), (32, 80)):
        grad = torch.randn(*shape, generator=generator)
        ours = orthogonalize_fp32(grad, coefficients, DEFAULT_NS_STEPS, 1e-7)
        torchs = TORCH_ORTHOGONALIZE(grad, coefficients, DEFAULT_NS_STEPS, 1e-7).float()
        assert ours.dtype == torch.float32 and ours.shape == grad.shape
        # five bf16 iterations drift ~2 % from the float32 result (measured 1.6-1.8 %)
        assert (ours - torchs).norm() < 0.03 * torchs.norm()


def test_auto_precision_is_bf16_where_the_device_multiplies_it_natively():
    from draftflow.hardware import cpu_has_native_bf16
    from draftflow.train.distributed import uses_bf16

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert uses_bf16(gpu, "auto") and not uses_bf16(gpu, "fp32")
    assert uses_bf16(cpu, "bf16") and not uses_bf16(cpu, "fp32")
    # A CPU that emulates bf16 trains in fp32 (a bf16 GEMM 9x slower there).
    assert uses_bf16(cpu, "auto") == cpu_has_native_bf16()
