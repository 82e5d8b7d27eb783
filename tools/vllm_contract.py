"""The contract between draftflow's capture module and vLLM's internals, checked per release
without a GPU and without importing vLLM.

Every name the capture adapters (draftflow/capture/adapters/, worker_extension.py, the hooks
and native backends) touch inside vLLM is listed in ``CHECKS``, each for the releases it applies
to. For a release, the ``.py`` members it needs are read from vLLM's official wheel as a zip:
from a local wheel, or from PyPI with HTTP range requests (the zip's directory and those members
only, a few hundred kB of a 300 MB wheel), and parsed with ``ast``. A missing class, method,
attribute, field or parameter is reported with the release and the name.

    python tools/vllm_contract.py fetch                    # fill the cache (network), then check
    python tools/vllm_contract.py check                    # every supported release, from the cache
    python tools/vllm_contract.py check --wheel vllm-0.33.0-....whl   # one local wheel

The cache (``.test-cache/vllm-contract/vllm-X.json``: each needed member's source, or null where
the wheel has no such member) is what tests/test_vllm_contract.py reads; CI fills it before
``make test`` (.ci/run). A new release: add it to ``RELEASES``, run ``fetch``, then the GPU lane
(docs/capture.md, "A new vLLM release").
"""

from __future__ import annotations

import argparse
import ast
import functools
import io
import json
import os
import re
import sys
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".test-cache" / "vllm-contract"
# One official release per minor version the hooks backend supports (HOOKS_VERSIONS in
# draftflow/capture/adapters/__init__.py), the first of each.
RELEASES = tuple(f"0.{minor}.0" for minor in range(16, 34))
PYPI_JSON = "https://pypi.org/pypi/vllm/json"
# Range requests are rounded up to this many bytes (one request per member, most of them).
READ_BLOCK = 64 << 10


# ----------------------------------------------------------------------------- the contract
def release_key(text: str) -> tuple[int, ...]:
    """(major, minor, patch): this runs before any venv exists, so without packaging."""
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


@dataclass(frozen=True)
class Check:
    """One name vLLM must have. ``kind``: ``method`` / ``attribute`` (of a class: methods,
    properties, class-level fields, ``self.X`` assignments, bases followed), ``parameters`` (a
    method's parameter names include ``names``), ``function`` (module level), ``base`` (the class
    lists ``names[0]`` among its bases, followed), ``text`` (the member's source contains it)."""

    why: str
    member: str
    kind: str
    owner: str
    names: tuple[str, ...]
    since: str = "0.0"
    until: str | None = None  # exclusive

    def applies(self, release: str) -> bool:
        version = release_key(release)
        return version >= release_key(self.since) and (
            self.until is None or version < release_key(self.until)
        )


V1 = "vllm/v1/worker/gpu_model_runner.py"
V2 = "vllm/v1/worker/gpu/model_runner.py"
MODELS = "vllm/model_executor/models/"
CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
# Model Runner V2 as the hooks backend reads it (adapters/v2_runner.py): the GPU default for
# some models from 0.22.
V2_SINCE = "0.22"
# The native backend's minimum (NATIVE_MIN_VERSION in draftflow/capture/backends/native.py): the
# connector's load_hidden_states / cleanup_hidden_states, which it imports, arrive in 0.22.
NATIVE_SINCE = "0.22"
# The CPU build's connector subclass (adapters/native_connector.py) overrides the stock one's
# asynchronous write and reads its private state, all there from 0.24.
CPU_CONNECTOR_SINCE = "0.24"

# (family, model file, decoder class, decoder-layer class): adapters/decoder.py finds
# ``<decoder>.layers`` and ``<decoder>.norm`` and reads the layers' ``positions`` and
# ``hidden_states`` by name (tests/families.py builds these targets).
DECODERS = (
    ("Llama", "llama.py", "LlamaModel", "LlamaDecoderLayer"),
    ("Qwen3", "qwen3.py", "Qwen3Model", "Qwen3DecoderLayer"),
    ("Qwen3-MoE", "qwen3_moe.py", "Qwen3MoeModel", "Qwen3MoeDecoderLayer"),
    ("DeepSeek-V2/V3", "deepseek_v2.py", "DeepseekV2Model", "DeepseekV2DecoderLayer"),
    ("GPT-OSS", "gpt_oss.py", "GptOssModel", "TransformerBlock"),
)
# Wrappers whose text model the decoder search finds under ``language_model``.
WRAPPERS = (
    ("Kimi-K2.5", "kimi_k25.py", "KimiK25ForConditionalGeneration"),
    ("Llava", "llava.py", "LlavaForConditionalGeneration"),
)
# Causal LMs the native backend's extractor captures: they take EAGLE-3 aux layers.
EAGLE3_TARGETS = (
    ("Llama", "llama.py", "LlamaForCausalLM"),
    ("Qwen3", "qwen3.py", "Qwen3ForCausalLM"),
    ("Qwen3-MoE", "qwen3_moe.py", "Qwen3MoeForCausalLM"),
)


def _checks() -> tuple[Check, ...]:
    checks = [
        # ---- the two-phase step and the V1 runner (adapters/v1_runner.py, decoder.py)
        Check(
            "V1 runner: the wrapped forward, the sampling phase, the model",
            V1,
            "method",
            "GPUModelRunner",
            ("execute_model", "sample_tokens", "get_model"),
        ),
        Check(
            "V1 runner: the persistent batch",
            V1,
            "attribute",
            "GPUModelRunner",
            ("input_batch", "model_config"),
        ),
        Check(
            "V1 runner: request order of the flattened batch",
            "vllm/v1/worker/gpu_input_batch.py",
            "attribute",
            "InputBatch",
            ("req_ids",),
        ),
        # ---- Model Runner V2 (adapters/v2_runner.py)
        Check(
            "V2 runner: the wrapped forward, the sampling phase, the model",
            V2,
            "method",
            "GPUModelRunner",
            ("execute_model", "sample_tokens", "get_model"),
            V2_SINCE,
        ),
        Check(
            "V2 runner: request states (how the adapter recognises V2), the step's state",
            V2,
            "attribute",
            "GPUModelRunner",
            ("req_states", "execute_model_state", "model_config"),
            V2_SINCE,
        ),
        Check(
            "V2 runner: the state execute_model leaves for sample_tokens",
            V2,
            "attribute",
            "ExecuteModelState",
            ("input_batch",),
            V2_SINCE,
        ),
        Check(
            "V2 runner: the batch layout",
            "vllm/v1/worker/gpu/input_batch.py",
            "attribute",
            "InputBatch",
            ("req_ids", "num_scheduled_tokens"),
            V2_SINCE,
        ),
        # ---- the scheduler's output the wrapped execute_model reads (worker_extension.py)
        Check(
            "scheduler output of a step",
            "vllm/v1/core/sched/output.py",
            "attribute",
            "SchedulerOutput",
            ("num_scheduled_tokens", "total_num_scheduled_tokens", "scheduled_new_reqs"),
        ),
        Check(
            "a request's first schedule",
            "vllm/v1/core/sched/output.py",
            "attribute",
            "NewRequestData",
            ("req_id", "prompt_token_ids", "sampling_params"),
        ),
        Check(
            "the capture file key travels in SamplingParams.extra_args",
            "vllm/sampling_params.py",
            "attribute",
            "SamplingParams",
            ("extra_args",),
        ),
        # ---- the worker-extension mechanism (backends/hooks.py)
        Check(
            "worker_extension_cls mixes the extension into each worker",
            "vllm/config/parallel.py",
            "attribute",
            "ParallelConfig",
            ("worker_extension_cls",),
        ),
        Check(
            "the driver calls the extension's methods",
            "vllm/entrypoints/llm.py",
            "method",
            "LLM",
            ("collective_rpc",),
        ),
        Check(
            "the worker the extension is mixed into",
            "vllm/v1/worker/gpu_worker.py",
            "attribute",
            "Worker",
            ("model_runner", "vllm_config"),
        ),
        Check(
            "tensor- and pipeline-parallel ranks (decoder.parallel_ranks)",
            "vllm/distributed/parallel_state.py",
            "function",
            "",
            ("get_pp_group", "get_tensor_model_parallel_rank"),
        ),
        # ---- vLLM's extractor (backends/native.py, adapters/native_connector.py)
        Check(
            "speculative method extract_hidden_states",
            "vllm/config/speculative.py",
            "text",
            "",
            ("extract_hidden_states",),
            NATIVE_SINCE,
        ),
        Check(
            "the hidden-states connector and its file helpers",
            CONNECTOR,
            "function",
            "",
            ("extract_from_kv_cache", "load_hidden_states", "cleanup_hidden_states"),
            NATIVE_SINCE,
        ),
        Check(
            "the connector's file path in kv_transfer_params",
            CONNECTOR,
            "text",
            "",
            ("hidden_states_path",),
            NATIVE_SINCE,
        ),
        Check(
            "what the CPU connector subclass overrides and reads",
            CONNECTOR,
            "attribute",
            "ExampleHiddenStatesConnector",
            (
                "_submit_async_write",
                "_kv_cache",
                "_block_size",
                "_lock_fds",
                "use_lock",
                "_is_tp_rank_zero",
                "_req_copy_events",
            ),
            CPU_CONNECTOR_SINCE,
        ),
        Check(
            "a pending write as the CPU connector reads it",
            CONNECTOR,
            "attribute",
            "PendingSave",
            ("req_id", "filename", "block_ids", "token_ids"),
            CPU_CONNECTOR_SINCE,
        ),
        # ---- EAGLE-3 aux layers (the extractor's layer ids; renamed in 0.18)
        Check(
            "EAGLE-3 aux layers interface",
            MODELS + "interfaces.py",
            "method",
            "SupportsEagle3",
            ("set_aux_hidden_state_layers", "get_eagle3_aux_hidden_state_layers"),
            "0.0",
            "0.18",
        ),
        Check(
            "EAGLE-3 aux layers interface (0.18 names)",
            MODELS + "interfaces.py",
            "method",
            "SupportsEagle3",
            ("set_aux_hidden_state_layers", "get_eagle3_default_aux_hidden_state_layers"),
            "0.18",
        ),
    ]
    for family, module, model, layer in DECODERS:
        checks.append(
            Check(
                f"{family}: the decoder's layers and final norm",
                MODELS + module,
                "attribute",
                model,
                ("layers", "norm"),
            )
        )
        checks.append(
            Check(
                f"{family}: decoder-layer call by name",
                MODELS + module,
                "parameters",
                f"{layer}.forward",
                ("positions", "hidden_states"),
            )
        )
    for family, module, wrapper in WRAPPERS:
        checks.append(
            Check(
                f"{family}: the text model inside the wrapper",
                MODELS + module,
                "attribute",
                wrapper,
                ("language_model",),
            )
        )
    for family, module, causal_lm in EAGLE3_TARGETS:
        checks.append(
            Check(
                f"{family}: takes EAGLE-3 aux layers (native)",
                MODELS + module,
                "base",
                causal_lm,
                ("SupportsEagle3",),
                NATIVE_SINCE,
            )
        )
    return tuple(checks)


CHECKS = _checks()


# ----------------------------------------------------------------------------- sources
class HttpRangeFile(io.RawIOBase):
    """A remote file read with HTTP range requests, for ``zipfile``: only the bytes read travel."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.pos, self.fetched = url, size, 0, 0
        self._blocks: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def _get(self, start: int, end: int) -> bytes:
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end - 1}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            if response.status != 206:
                raise RuntimeError(f"{self.url}: the server ignores range requests")
            data = response.read()
        self.fetched += len(data)
        return data

    def read(self, size: int = -1) -> bytes:
        end = self.size if size is None or size < 0 else min(self.size, self.pos + size)
        if end <= self.pos:
            return b""
        first, last = self.pos // READ_BLOCK, (end - 1) // READ_BLOCK
        missing = [b for b in range(first, last + 1) if b not in self._blocks]
        if missing:  # one request for the whole missing span
            lo, hi = missing[0] * READ_BLOCK, min(self.size, (missing[-1] + 1) * READ_BLOCK)
            data = self._get(lo, hi)
            for b in range(missing[0], missing[-1] + 1):
                self._blocks[b] = data[(b - missing[0]) * READ_BLOCK :][:READ_BLOCK]
        joined = b"".join(self._blocks[b] for b in range(first, last + 1))
        out = joined[self.pos - first * READ_BLOCK : end - first * READ_BLOCK]
        self.pos = end
        return out

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


@functools.cache
def pypi_releases() -> dict[str, list[dict]]:
    with urllib.request.urlopen(PYPI_JSON, timeout=60) as response:
        return json.load(response)["releases"]


def official_wheel(release: str) -> tuple[str, int]:
    """URL and size of the release's x86-64 Linux wheel on PyPI (its JSON API)."""
    files = pypi_releases().get(release, [])
    wheels = [f for f in files if f["filename"].endswith(".whl") and "x86_64" in f["filename"]]
    if not wheels:
        raise RuntimeError(f"vLLM {release}: PyPI lists no x86-64 wheel")
    # A mirror may serve the URL relative to the JSON's.
    return urllib.parse.urljoin(PYPI_JSON, wheels[0]["url"]), int(wheels[0]["size"])


class WheelSource:
    """Members of a wheel (local path or remote zip), recorded for the cache."""

    def __init__(self, archive: zipfile.ZipFile, origin: str) -> None:
        self.archive, self.origin = archive, origin
        self.names = set(archive.namelist())
        self.members: dict[str, str | None] = {}

    def read(self, member: str) -> str | None:
        if member not in self.members:
            found = member in self.names
            self.members[member] = archive_text(self.archive, member) if found else None
        return self.members[member]


def archive_text(archive: zipfile.ZipFile, member: str) -> str:
    return archive.read(member).decode("utf-8")


class CachedSource:
    """A release's members from the cache; a member the cache lacks is an error, not absent."""

    def __init__(self, path: Path) -> None:
        data = json.loads(path.read_text())
        self.origin = data["origin"]
        self.members: dict[str, str | None] = data["members"]
        self.path = path

    def read(self, member: str) -> str | None:
        if member not in self.members:
            raise KeyError(f"{self.path} lacks {member}: run tools/vllm_contract.py fetch")
        return self.members[member]


def cache_path(release: str, cache: Path = CACHE) -> Path:
    return cache / f"vllm-{release}.json"


def save_cache(release: str, source: WheelSource, fetched: int, cache: Path = CACHE) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    path = cache_path(release, cache)
    record = {"origin": source.origin, "fetched_bytes": fetched, "members": source.members}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, sort_keys=True))
    os.replace(tmp, path)  # atomic: a cut-off fetch leaves no half file


# ----------------------------------------------------------------------------- ast reading
class Module:
    """One member's parsed source: its classes and the names it imports from vLLM modules."""

    def __init__(self, member: str, source: str) -> None:
        self.member = member
        self.tree = ast.parse(source)
        self.classes = {n.name: n for n in self.tree.body if isinstance(n, ast.ClassDef)}
        self.functions = {
            n.name for n in self.tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        self.imports: dict[str, tuple[str, str]] = {}  # local name -> (module, name)
        package = member.rsplit("/", 1)[0].split("/")
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and (node.module or node.level):
                dotted = node.module or ""
                if node.level:  # from .qwen2 import Qwen2Model
                    parent = package[: len(package) - node.level + 1]
                    dotted = ".".join([*parent, *([dotted] if dotted else [])])
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (dotted, alias.name)


def module_members(module: str) -> tuple[str, str]:
    """The two members a dotted module may be: ``a/b.py`` or ``a/b/__init__.py``."""
    path = module.replace(".", "/")
    return f"{path}.py", f"{path}/__init__.py"


def class_names(node: ast.ClassDef) -> set[str]:
    """Methods, properties, class-level fields and ``self.X`` assignments of one class body."""
    names: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
        elif isinstance(item, ast.Assign):
            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
    for sub in ast.walk(node):
        targets = []
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
            targets = [sub.target]
        for target in targets:
            for leaf in ast.walk(target):
                if (
                    isinstance(leaf, ast.Attribute)
                    and isinstance(leaf.value, ast.Name)
                    and leaf.value.id == "self"
                ):
                    names.add(leaf.attr)
    return names


def base_names(node: ast.ClassDef) -> list[str]:
    out = []
    for base in node.bases:
        if isinstance(base, ast.Subscript):  # Generic[T], Protocol[...]
            base = base.value
        if isinstance(base, ast.Name):
            out.append(base.id)
        elif isinstance(base, ast.Attribute):
            out.append(base.attr)
    return out


class Reader:
    """Classes of one release, followed through their bases across vLLM's modules."""

    def __init__(self, source) -> None:
        self.source = source
        self._modules: dict[str, Module | None] = {}

    def module(self, member: str) -> Module | None:
        if member not in self._modules:
            text = self.source.read(member)
            self._modules[member] = Module(member, text) if text is not None else None
        return self._modules[member]

    def lineage(self, member: str, name: str, depth: int = 0) -> list[tuple[Module, ast.ClassDef]]:
        """The class and its vLLM base classes (nearest first)."""
        module = self.module(member)
        if module is None or depth > 8:
            return []
        node = module.classes.get(name)
        if node is None:
            imported = module.imports.get(name)
            return self._imported(imported, depth) if imported else []
        found = [(module, node)]
        for base in base_names(node):
            if base in module.classes:
                found += self.lineage(member, base, depth + 1)
            elif base in module.imports:
                found += self._imported(module.imports[base], depth + 1)
        return found

    def _imported(self, imported: tuple[str, str], depth: int) -> list:
        dotted, name = imported
        if not dotted.startswith("vllm"):
            return []
        for candidate in module_members(dotted):
            if self.source.read(candidate) is not None:
                return self.lineage(candidate, name, depth)
        return []


def check_release(source, release: str, checks: Iterable[Check] = CHECKS) -> list[str]:
    """Every broken expectation of this release, each naming the release and the name."""
    reader = Reader(source)
    problems = []
    for check in checks:
        if not check.applies(release):
            continue
        problems += [f"vLLM {release}: {p} ({check.why})" for p in _run(reader, check)]
    return problems


def _run(reader: Reader, check: Check) -> list[str]:
    module = reader.module(check.member)
    if module is None:
        return [f"{check.member} is missing"]
    where = check.member
    if check.kind == "text":
        text = ast.unparse(module.tree)
        return [f"{where} never mentions {n!r}" for n in check.names if n not in text]
    if check.kind == "function":
        return [f"{where} has no function {n}" for n in check.names if n not in module.functions]
    owner, _, method = check.owner.partition(".")
    lineage = reader.lineage(check.member, owner)
    if not lineage:
        return [f"{where} has no class {owner}"]
    if check.kind in ("attribute", "method"):
        names = set().union(*(class_names(node) for _, node in lineage))
        return [f"{where}: {owner} has no {check.kind} {n}" for n in check.names if n not in names]
    if check.kind == "base":
        bases = {b for _, node in lineage for b in base_names(node)}
        return [f"{where}: {owner} does not derive from {n}" for n in check.names if n not in bases]
    if check.kind == "parameters":
        for _, node in lineage:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    args = item.args
                    params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
                    return [
                        f"{where}: {owner}.{method} has no parameter {n}"
                        for n in check.names
                        if n not in params
                    ]
        return [f"{where}: {owner} has no method {method}"]
    raise ValueError(f"unknown check kind {check.kind}")


# ----------------------------------------------------------------------------- commands
def needed_members(source, release: str) -> None:
    """Read every member the checks (and the bases they follow) need: fills a WheelSource."""
    check_release(source, release)


def fetch(release: str, cache: Path = CACHE) -> int:
    """Read the release's needed members from PyPI into the cache; the bytes fetched."""
    url, size = official_wheel(release)
    remote = HttpRangeFile(url, size)
    with zipfile.ZipFile(io.BufferedReader(remote, buffer_size=READ_BLOCK)) as archive:
        source = WheelSource(archive, url)
        needed_members(source, release)
    save_cache(release, source, remote.fetched, cache)
    return remote.fetched


def release_of_wheel(path: Path) -> str:
    match = re.match(r"vllm-([0-9][^-]*)-", path.name)
    if not match:
        raise ValueError(f"{path.name}: not a vllm wheel's name (vllm-X.Y.Z-...whl)")
    return match.group(1)


def check_wheel(path: Path, release: str | None = None) -> list[str]:
    release = release or release_of_wheel(path)
    with zipfile.ZipFile(path) as archive:
        return check_release(WheelSource(archive, str(path)), release)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["fetch", "check"])
    parser.add_argument("--releases", nargs="+", default=list(RELEASES))
    parser.add_argument("--wheel", type=Path, help="check one local wheel instead")
    parser.add_argument("--release", help="the local wheel's release (default: from its name)")
    parser.add_argument("--cache", type=Path, default=CACHE)
    args = parser.parse_args(argv)
    if args.wheel:
        problems = check_wheel(args.wheel, args.release)
        print("\n".join(problems) or f"{args.wheel.name}: every contract name is there")
        return 1 if problems else 0
    problems = []
    total = 0
    for release in args.releases:
        if args.command == "fetch" and not cache_path(release, args.cache).exists():
            fetched = fetch(release, args.cache)
            total += fetched
            print(f"vLLM {release}: fetched {fetched / 1e3:.0f} kB", flush=True)
        found = check_release(CachedSource(cache_path(release, args.cache)), release)
        print(f"vLLM {release}: {'ok' if not found else f'{len(found)} broken'}", flush=True)
        problems += found
    if args.command == "fetch":
        print(f"fetched {total / 1e6:.2f} MB in all")
    print("\n".join(problems))
    # fetch only fills the cache (CI's step before make test); the test reports what broke.
    return 1 if problems and args.command == "check" else 0


if __name__ == "__main__":
    sys.exit(main())
