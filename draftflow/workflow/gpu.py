"""GPU leases: give every concurrent job on one machine its own devices.

``snakemake --resources gpu=8`` only *counts* GPUs; it does not say which job gets which
device. Every GPU rule's script therefore claims its devices here before any CUDA work::

    with gpu_lease(snakemake.resources.gpu) as devices:
        ...  # CUDA_VISIBLE_DEVICES now names exactly `devices`

A lease is one ``fcntl.flock`` per device on a lock file in a shared directory. The kernel
drops a flock when its process dies, so a crashed or killed job can never leave a device
claimed. When a cluster scheduler has already assigned devices (SLURM sets both
``SLURM_JOB_ID`` and ``CUDA_VISIBLE_DEVICES``), that assignment is used untouched; so is an
enclosing lease's (a nested call, or a child process of a job that holds a lease).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

NUM_GPUS_ENV = "DRAFTFLOW_NUM_GPUS"
LOCK_DIR_ENV = "DRAFTFLOW_GPU_LOCK_DIR"
# Set while a lease is held, so a nested lease (or a child process of the job) reuses the
# job's devices instead of waiting for locks its own job holds.
LEASED_ENV = "DRAFTFLOW_GPU_LEASED"
DEFAULT_TIMEOUT_S = 24 * 3600.0


def default_lock_dir() -> Path:
    """Machine-wide directory of device lock files (``$DRAFTFLOW_GPU_LOCK_DIR`` overrides).

    It must be the same for every job on the machine, so it does not depend on the workflow.
    """
    configured = os.environ.get(LOCK_DIR_ENV)
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / "draftflow-gpu-locks"


def count_gpus() -> int:
    """Number of GPUs on this machine, without initialising CUDA in this process.

    Order: ``$DRAFTFLOW_NUM_GPUS`` (tests, or to reserve part of a machine), ``nvidia-smi -L``,
    then ``torch.cuda.device_count()`` in a child process (so this process stays CUDA-free and
    the ``CUDA_VISIBLE_DEVICES`` we set later still takes effect).
    """
    configured = os.environ.get(NUM_GPUS_ENV)
    if configured is not None:
        try:
            count = int(configured)
        except ValueError:
            raise ValueError(
                f"{NUM_GPUS_ENV}={configured!r} is not a whole number of GPUs"
            ) from None
        if count < 0:
            raise ValueError(f"{NUM_GPUS_ENV}={count} must be 0 or more")
        return count
    if shutil.which("nvidia-smi"):
        result = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=False
        )
        if result.returncode == 0:
            return sum(1 for line in result.stdout.splitlines() if line.startswith("GPU "))
    result = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return int(result.stdout.strip()) if result.returncode == 0 else 0


def device_pool() -> list[str]:
    """The device ids jobs may lease: ``CUDA_VISIBLE_DEVICES`` when a user narrowed it, else all."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [device.strip() for device in visible.split(",") if device.strip()]
    return [str(index) for index in range(count_gpus())]


def existing_assignment() -> tuple[str, list[str]] | None:
    """(who, devices) when this job already has devices: from SLURM or an enclosing lease."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    if os.environ.get(LEASED_ENV) == visible:
        return "an enclosing draftflow lease", device_pool()
    if os.environ.get("SLURM_JOB_ID"):
        return f"SLURM job {os.environ['SLURM_JOB_ID']}", device_pool()
    return None


def _lock_file_name(device: str) -> str:
    # Device ids may be UUIDs ("GPU-1234…", "MIG-…"); keep the name a plain file name.
    return "gpu-" + "".join(char if char.isalnum() or char in "-_." else "_" for char in device)


def _owner_of(lock_dir: Path, device: str) -> str:
    probe = _try_lock(lock_dir, device)
    if probe is not None:
        os.close(probe)
        return "free"
    try:
        return (lock_dir / (_lock_file_name(device) + ".lock")).read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def _try_lock(lock_dir: Path, device: str) -> int | None:
    """Flock the device's lock file without waiting; the open descriptor is the lease."""
    path = lock_dir / (_lock_file_name(device) + ".lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        # Another user's lock file: a read-only descriptor can hold a flock too.
        fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    # Who holds it, for the message another job prints while it waits.
    owner = f"pid {os.getpid()} on {socket.gethostname()}"
    if os.environ.get("SNAKEMAKE_JOB_NAME"):
        owner += f" ({os.environ['SNAKEMAKE_JOB_NAME']})"
    with contextlib.suppress(OSError):  # a read-only descriptor cannot say who holds it
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner.encode() + b"\n", 0)
    return fd


def _release(fds: dict[str, int]) -> None:
    for fd in fds.values():
        # Closing the descriptor drops the flock; the file itself stays for the next job.
        os.close(fd)
    fds.clear()


def _claim(lock_dir: Path, pool: list[str], count: int) -> dict[str, int] | None:
    """All-or-nothing: lock ``count`` free devices, or hold none (no hold-and-wait deadlock)."""
    held: dict[str, int] = {}
    for device in pool:
        fd = _try_lock(lock_dir, device)
        if fd is not None:
            held[device] = fd
            if len(held) == count:
                return held
    _release(held)
    return None


@contextlib.contextmanager
def gpu_lease(
    count: int,
    lock_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    poll_s: float = 2.0,
) -> Iterator[list[str]]:
    """Hold ``count`` devices of this machine for the duration of the ``with`` block.

    Yields the device ids and sets ``CUDA_VISIBLE_DEVICES`` to them (restored afterwards);
    call it before anything initialises CUDA. ``count == 0`` is a no-op for CPU jobs.
    Waits up to ``timeout_s`` for free devices, then raises ``TimeoutError`` naming who holds them.
    """
    count = int(count)
    if count < 0:
        raise ValueError(f"gpu_lease count={count} must be 0 or more")
    if count == 0:
        yield []
        return

    existing = existing_assignment()
    if existing is not None:
        owner, assigned = existing
        if len(assigned) < count:
            raise ValueError(
                f"{owner} gave this job {len(assigned)} GPU(s) "
                f"(CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}) "
                f"but it needs {count}: request gpu={count} for this rule"
            )
        log.info("using the GPUs %s from %s", ",".join(assigned), owner)
        yield assigned
        return

    pool = device_pool()
    if count > len(pool):
        raise ValueError(
            f"a job needs {count} GPU(s) but this machine offers {len(pool)} "
            f"({','.join(pool) or 'none'}; set by CUDA_VISIBLE_DEVICES, {NUM_GPUS_ENV} or "
            "nvidia-smi): lower the rule's gpu resource or run it on a bigger machine"
        )
    lock_path = Path(lock_dir) if lock_dir is not None else default_lock_dir()
    if not lock_path.is_dir():
        lock_path.mkdir(parents=True, exist_ok=True)
        # GPUs are shared by every user of the machine, so is the lock directory (like /tmp).
        with contextlib.suppress(OSError):
            lock_path.chmod(0o1777)

    deadline = time.monotonic() + timeout_s
    announced = False
    while (held := _claim(lock_path, pool, count)) is None:
        if time.monotonic() >= deadline:
            owners = "; ".join(f"{device}: {_owner_of(lock_path, device)}" for device in pool)
            raise TimeoutError(
                f"no {count} free GPU(s) of {','.join(pool)} after {timeout_s:g} s "
                f"(locks in {lock_path}; holders: {owners})"
            )
        if not announced:
            log.info("waiting for %d free GPU(s) of %s (locks in %s)", count, pool, lock_path)
            announced = True
        time.sleep(poll_s)

    devices = list(held)
    previous = {name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", LEASED_ENV)}
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ[LEASED_ENV] = ",".join(devices)
    log.info("leased GPU(s) %s", os.environ["CUDA_VISIBLE_DEVICES"])
    try:
        yield devices
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _release(held)
