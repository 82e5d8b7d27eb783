"""speculators' own EAGLE-3 recipe on the conversations of a finished draftflow run, benchmarked in
draftflow's bench beside draftflow's own draft (issue 18, "side by side").

Given a workdir that ``studies/quality_curve.py run`` finished (any draftflow workdir will do),
the stages below write into ``--out``; each is skipped when its output is already there, so
calling ``run`` again resumes a stopped run:

1. ``conversations``: ``conversations.jsonl``, the conversations draftflow trained on (the corpus
   its tokenize rule read, restricted to the ids of its train split) as speculators'
   ``conversations`` rows.
2. ``data``: a vLLM server started the way speculators' ``scripts/launch_vllm.py`` starts it
   (speculative method ``extract_hidden_states``, vLLM's ``ExampleHiddenStatesConnector``
   writing each request's hidden states to disk, layers [2, L // 2, L - 3, L]); through it
   ``speculators prepare-data`` renders and masks the conversations (``data/``) and
   ``speculators generate-offline-data`` stores their hidden states (``hidden_states/``).
3. ``train-<recipe>``: ``speculators train`` on them (it needs an accelerator), with its eager
   losses (``LOSS_IMPLEMENTATION``); the last epoch's directory under ``<recipe>/checkpoints/`` is
   the draft vLLM loads.
   - ``defaults``: speculators' own defaults (20 epochs, Muon, the full vocabulary,
     8,192 tokens per step);
   - ``draftflow``: the workdir's ``train:`` and ``vocab:`` settings (epochs, optimizer,
     learning rate, schedule, warm-up, tokens per step, test-time steps, loss, draft vocabulary).
4. ``bench-<recipe>``: draftflow's bench (``draftflow.bench.suite.run_benchmark``) with the
   workdir's prompt sets and ``bench:`` settings: ``<recipe>/bench/``, the same tables as the
   workdir's ``results/bench/``.

``summary.json`` then holds the seconds of every stage and each recipe's τ per prompt set and k.

Usage::

    python studies/speculators_side.py run --workdir W/2560 --out S/2560   # on the GPU node
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workdir_study import TARGET, add_run_parser, workdir_config

if TYPE_CHECKING:
    from draftflow.engine_settings import EngineSettings

REPO = Path(__file__).resolve().parents[1]
RECIPES = ("defaults", "draftflow")
# A quality-curve workdir's config files, merged in this order (as its Snakemake run merges them).
CONFIG_FILES = ("config/examples/smollm2-gpu.yaml", "curve.yaml")
SERVER_START_S = 900
# How speculators computes its losses, for every recipe: its fused Triton losses inside its
# torch.compile'd step stop torch 2.11's Dynamo on a GPU ("ListVariable ... is already
# tracked for mutation"); its eager losses compute the same terms.
LOSS_IMPLEMENTATION = "eager"


def corpus_path(workdir: Path) -> Path:
    """The corpus the tokenize rule read: the regenerated one where regeneration ran."""
    regenerated = workdir / "results" / "corpus" / "regenerated.jsonl"
    return (
        regenerated if regenerated.exists() else workdir / "results" / "corpus" / "ingested.jsonl"
    )


def train_ids(workdir: Path) -> set[str]:
    import pyarrow.parquet as pq

    table = pq.read_table(workdir / "results" / "split" / "train.parquet", columns=["id"])
    return set(table.column("id").to_pylist())


def write_conversations(workdir: Path, out: Path) -> int:
    """speculators' ``conversations`` rows for the train split's conversations; their count."""
    from draftflow.io import atomic_write_text

    keep = train_ids(workdir)
    rows = []
    with corpus_path(workdir).open(encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            if record["id"] in keep:
                rows.append(json.dumps({"id": record["id"], "conversations": record["messages"]}))
    if not rows:
        raise ValueError(f"{workdir}: no conversation of the train split found in the corpus")
    atomic_write_text(out, "\n".join(rows) + "\n")
    return len(rows)


def server_context(target: Path, seq_length: int) -> int:
    """The server's context length: the target's own, as speculators launches vLLM (without
    ``--max-model-len``). Its renderer refuses a conversation that fills the context ("max_tokens
    must be at least 1"); with the context at ``--seq-length`` that dropped 29 of 537
    conversations on the GPU, which prepare-data (like draftflow) would have truncated."""
    from draftflow.capture.layers import text_config
    from draftflow.io import read_json

    config = text_config(read_json(target / "config.json"))
    return max(seq_length, int(config.get("max_position_embeddings") or seq_length))


def server_command(
    target: Path, hidden_states: Path, layer_ids: list[int], port: int, engine: dict[str, Any]
) -> list[str]:
    """``vllm serve`` as speculators' ``scripts/launch_vllm.py`` builds it, through the API
    server's module (the CPU build's ``vllm`` command looks for a distribution named vllm)."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }
    transfer = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(hidden_states)},
    }
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(target),
        "--port",
        str(port),
        "--max-model-len",
        str(engine["max_model_len"]),
        "--gpu-memory-utilization",
        str(engine["gpu_memory_utilization"]),
        *(
            ["--kv-cache-memory-bytes", str(engine["kv_cache_memory_bytes"])]
            if engine.get("kv_cache_memory_bytes")
            else []
        ),
        *(["--trust-remote-code"] if engine.get("trust_remote_code") else []),
        "--speculative-config",
        json.dumps(speculative),
        "--kv-transfer-config",
        json.dumps(transfer),
    ]
    # Newer vLLM serves /v1/chat/completions/render (prepare-data's renderer) only when asked.
    if importlib.util.find_spec("vllm.entrypoints.scale_out") is not None:
        command.append("--enable-scale-out")
    return command


def server_env(extract: EngineSettings) -> dict[str, str]:
    """draftflow's engines' environment for the server (on GPUs without flashinfer, vLLM's own
    sampler): the extract stage's reserved cores and KV cache (``extract``: its EngineSettings).
    The server command sets no tensor parallelism, model runner or batch invariance."""
    from draftflow.engine import engine_env, on_cpu_build

    return engine_env(
        reserved_cpus=extract.reserved_cpus,
        model_runner="default",
        kv_cache_memory_bytes=extract.kv_cache_memory_bytes,
        tensor_parallel_size=1,
        cpu=on_cpu_build(),
        deterministic=False,
    )


@contextmanager
def vllm_server(
    command: list[str], port: int, log_path: Path, env: dict[str, str] | None = None
) -> Iterator[str]:
    """The server running until the block ends, with ``env`` over this process's environment;
    its base URL. A server that exits before it answers /health raises with the end of its
    log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-30:])
                raise RuntimeError(f"the vLLM server did not start ({log_path}):\n{tail}")
            time.sleep(2)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def speculators_cli(*args: str, log_path: Path, torchrun: int = 1) -> None:
    """One ``speculators`` subcommand (training over ``torchrun`` processes where there are
    several), logged to a file."""
    if torchrun > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc-per-node={torchrun}", "-m", "speculators.train", *args[1:]]
    else:
        command = [sys.executable, "-m", "speculators", *args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-30:])
        raise RuntimeError(f"speculators {args[0]} failed ({log_path}):\n{tail}")


def train_arguments(recipe: str, config: dict[str, Any]) -> list[str]:
    """The recipe's own flags for ``speculators train``."""
    if recipe == "defaults":
        return []
    if recipe != "draftflow":
        raise ValueError(f"recipe {recipe!r} is not one of {RECIPES}")
    train = config["train"]
    flags = {
        "--num-layers": train["num_layers"],
        "--ttt-steps": train["ttt_steps"],
        "--ttt-step-loss-decay": train["ttt_step_loss_decay"],
        "--loss-fn": train["loss"],
        "--epochs": train["epochs"],
        "--total-seq-len": train["tokens_per_batch"],
        "--optimizer": train["optimizer"],
        "--lr": train["lr"],
        "--weight-decay": train["weight_decay"],
        "--scheduler-type": train["scheduler"],
        "--scheduler-warmup-steps": train["warmup_steps"],
        "--seed": train["seed"],
        "--draft-vocab-size": config["vocab"]["draft_vocab_size"],
    }
    return [str(item) for pair in flags.items() for item in pair]


def last_checkpoint(checkpoints: Path) -> Path:
    """The last epoch's directory: speculators names them by epoch number."""
    epochs = sorted(
        (path for path in checkpoints.iterdir() if path.name.isdigit()),
        key=lambda path: int(path.name),
    )
    if not epochs or not (epochs[-1] / "config.json").exists():
        raise FileNotFoundError(f"{checkpoints}: no finished epoch checkpoint")
    return epochs[-1]


class Stages:
    """The stages over one workdir; seconds of each in ``out/stage_seconds.json``."""

    def __init__(
        self,
        workdir: Path,
        out: Path,
        port: int,
        gpus: int,
        config_files: tuple[str, ...] = CONFIG_FILES,
        ks: list[int] | None = None,
    ) -> None:
        self.workdir = workdir.resolve()
        self.out = out.resolve()
        self.port = port
        self.gpus = gpus
        self.config = workdir_config(self.workdir, config_files)
        # The k to bench: the workdir's own unless given (fewer engines where GPU time is short).
        self.ks = ks or [int(k) for k in self.config["bench"]["num_speculative_tokens"]]
        self.target = self.workdir / TARGET
        self.seconds_path = self.out / "stage_seconds.json"
        # A user's config turns remote code on; speculators' commands then need it too.
        self.remote_code = (
            ["--trust-remote-code"] if self.config["target"]["trust_remote_code"] else []
        )

    def timed(self, name: str, done: Path, work) -> None:
        from draftflow.io import atomic_write_json, read_json

        if done.exists():
            print(f"== {name}: done before ({done})", flush=True)
            return
        print(f"== {name}", flush=True)
        start = time.monotonic()
        work()
        seconds = read_json(self.seconds_path) if self.seconds_path.exists() else {}
        seconds[name] = round(time.monotonic() - start, 2)
        atomic_write_json(self.seconds_path, seconds)

    def conversations(self) -> None:
        path = self.out / "conversations.jsonl"
        self.timed("conversations", path, lambda: write_conversations(self.workdir, path))

    def data(self) -> None:
        self.timed("data", self.out / "hidden_states" / "done.json", self._data)

    def _data(self) -> None:
        from draftflow.capture.layers import capture_layers
        from draftflow.engine_settings import engine_settings
        from draftflow.io import atomic_write_json

        layers = capture_layers(self.target, self.config["extract"]["aux_layers"]).layer_ids
        # The extract stage's engine settings: the server captures what extract would.
        extract = engine_settings(self.config, "extract")
        engine = {
            "max_model_len": server_context(self.target, extract.max_model_len),
            "gpu_memory_utilization": extract.gpu_memory_utilization,
            "kv_cache_memory_bytes": extract.kv_cache_memory_bytes,
            "trust_remote_code": self.config["target"]["trust_remote_code"],
        }
        cache = self.out / "server_cache"
        hidden = self.out / "hidden_states"
        command = server_command(self.target, cache, layers, self.port, engine)
        env = server_env(extract)
        with vllm_server(command, self.port, self.out / "logs" / "server.log", env) as url:
            speculators_cli(
                "prepare-data",
                "--model", str(self.target),
                "--data", str(self.out / "conversations.jsonl"),
                "--render-endpoint", url,
                "--output", str(self.out / "data"),
                "--seq-length", str(self.config["tokenize"]["max_length"]),
                "--no-skip-token-freq",
                *self.remote_code,
                log_path=self.out / "logs" / "prepare-data.log",
            )  # fmt: skip
            speculators_cli(
                "generate-offline-data",
                "--preprocessed-data", str(self.out / "data"),
                "--endpoint", f"{url}/v1",
                "--output", str(hidden),
                "--validate-outputs",
                log_path=self.out / "logs" / "generate-offline-data.log",
            )  # fmt: skip
        files = sorted(hidden.glob("hs_*.safetensors"))
        if not files:
            raise RuntimeError(f"{hidden}: generate-offline-data wrote no hidden states")
        atomic_write_json(hidden / "done.json", {"files": len(files), "layer_ids": layers})

    def train(self, recipe: str) -> None:
        self.timed(f"train-{recipe}", self.out / recipe / "draft.json", lambda: self._train(recipe))

    def _train(self, recipe: str) -> None:
        from draftflow.io import atomic_write_json

        checkpoints = self.out / recipe / "checkpoints"
        speculators_cli(
            "train",
            "--verifier-name-or-path", str(self.target),
            "--data-path", str(self.out / "data"),
            "--hidden-states-path", str(self.out / "hidden_states"),
            "--save-path", str(checkpoints),
            "--on-missing", "raise",
            "--loss-implementation", LOSS_IMPLEMENTATION,
            *self.remote_code,
            *train_arguments(recipe, self.config),
            log_path=self.out / "logs" / f"train-{recipe}.log",
            torchrun=self.gpus,
        )  # fmt: skip
        draft = last_checkpoint(checkpoints)
        atomic_write_json(self.out / recipe / "draft.json", {"draft": str(draft)})

    def bench(self, recipe: str) -> None:
        done = self.out / recipe / "bench" / "done.json"
        self.timed(f"bench-{recipe}", done, lambda: self._bench(recipe, done))

    def _bench(self, recipe: str, done: Path) -> None:
        from workdir_study import bench_draft

        from draftflow.io import atomic_write_json, read_json

        draft = read_json(self.out / recipe / "draft.json")["draft"]
        out_dir = self.out / recipe / "bench"
        names = bench_draft(self.workdir, self.config, draft, self.ks, out_dir)
        atomic_write_json(done, {"draft": draft, "datasets": names})

    def summary(self) -> dict[str, Any]:
        from draftflow.bench.tables import read_speculative_rows
        from draftflow.io import atomic_write_json, read_json

        summary: dict[str, Any] = {
            "workdir": str(self.workdir),
            "stage_seconds": read_json(self.seconds_path) if self.seconds_path.exists() else {},
            "recipes": {},
        }
        for recipe in RECIPES:
            bench = self.out / recipe / "bench"
            if (bench / "done.json").exists():
                summary["recipes"][recipe] = {
                    "train_arguments": train_arguments(recipe, self.config),
                    "bench": read_speculative_rows(bench),
                }
        atomic_write_json(self.out / "summary.json", summary)
        return summary


def tau_at(rows_by_set: dict[str, list[dict[str, Any]]], k: int) -> dict[str, float]:
    """Per prompt set, τ at ``k`` (sets benched without that k are left out)."""
    return {
        name: row["acceptance_length"]
        for name, rows in rows_by_set.items()
        for row in rows
        if row["k"] == k
    }


def side_by_side(
    points: list[dict[str, Any]], summaries: dict[str, dict[str, Any]], k: int
) -> list[dict[str, Any]]:
    """One row per curve point with a speculators side (``summaries`` keyed by the point's
    workdir name): τ at ``k`` per prompt set of draftflow's draft and of each speculators recipe,
    and the seconds of each side's stages."""
    rows = []
    for point in points:
        summary = summaries.get(point["workdir"])
        if summary is None:
            continue
        tau = {"draftflow": tau_at(point["bench"], k)}
        for recipe, result in summary["recipes"].items():
            tau[f"speculators-{recipe}"] = tau_at(result["bench"], k)
        rows.append(
            {
                "workdir": point["workdir"],
                "train_tokens": point["train_tokens"],
                "k": k,
                "tau": tau,
                "seconds": {
                    "draftflow": point["gpu_seconds"],
                    "speculators": summary["stage_seconds"],
                },
            }
        )
    return rows


def plot_side_by_side(rows: list[dict[str, Any]], path: Path) -> None:
    """τ at the rows' k against train tokens: a panel per prompt set, a line per draft."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({name for row in rows for taus in row["tau"].values() for name in taus})
    drafts = list(dict.fromkeys(draft for row in rows for draft in row["tau"]))
    figure, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False)
    for axis, dataset in zip(axes[0], datasets, strict=True):
        for draft in drafts:
            held = [row for row in rows if dataset in row["tau"].get(draft, {})]
            axis.plot(
                [row["train_tokens"] / 1e6 for row in held],
                [row["tau"][draft][dataset] for row in held],
                marker="o",
                linestyle="-" if draft == "draftflow" else "--",
                label=draft,
            )
        axis.set(title=dataset, xlabel="train tokens (millions)", ylabel=f"τ at k = {rows[0]['k']}")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def compare(args: argparse.Namespace) -> None:
    from draftflow.io import atomic_write_json, read_json

    points = read_json(args.curve)["points"]
    summaries = {path.parent.name: read_json(path) for path in args.summaries}
    rows = side_by_side(points, summaries, args.k)
    if not rows:
        raise SystemExit(
            "no curve point has a speculators side (summary.json in a dir named "
            "after the point's workdir)"
        )
    atomic_write_json(args.out, {"curve": str(args.curve), "rows": rows})
    if args.plot:
        plot_side_by_side(rows, args.plot)
    for row in rows:
        print(row["workdir"], row["train_tokens"], json.dumps(row["tau"]))


def run(args: argparse.Namespace) -> None:
    stages = Stages(args.workdir, args.out, args.port, args.gpus, tuple(args.configfiles), args.ks)
    stages.conversations()
    stages.data()
    for recipe in args.recipes:
        stages.train(recipe)
        stages.bench(recipe)
    print(json.dumps(stages.summary(), indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = add_run_parser(sub, CONFIG_FILES)
    run_parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    run_parser.add_argument("--port", type=int, default=8765)
    run_parser.add_argument("--gpus", type=int, default=1, help="torchrun processes for training")
    run_parser.add_argument(
        "--ks", type=int, nargs="+", help="the k to bench (default: the workdir's bench k)"
    )
    compare_parser = sub.add_parser(
        "compare", help="draftflow's τ beside each speculators recipe's, per curve size"
    )
    compare_parser.add_argument("--curve", type=Path, required=True, help="a collect JSON")
    compare_parser.add_argument(
        "--summaries", type=Path, nargs="+", required=True,
        help="summary.json files, each in a directory named after its curve workdir",
    )  # fmt: skip
    compare_parser.add_argument("--k", type=int, default=3)
    compare_parser.add_argument("--out", type=Path, required=True)
    compare_parser.add_argument("--plot", type=Path, help="a PNG of τ against train tokens")
    args = parser.parse_args(argv)
    {"run": run, "compare": compare}[args.command](args)


if __name__ == "__main__":
    main()
