"""The state recorder on its own (no engine): rows filed by position into one file per request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftflow.capture.quant import BF16, FP8, Quantized, quantize_fp8
from draftflow.capture.recorder import STATE_DTYPE, RequestFile, StateRecorder, map_request_file

COLUMNS, HIDDEN = 2, 8


def _forward(recorder: StateRecorder, batch: list[tuple[str, torch.Tensor]], lengths: dict):
    """One fake forward: ``batch`` = (request id, positions) in batch order."""
    tokens = sum(int(p.numel()) for _, p in batch)
    recorder.begin(tokens, {rid: (lengths[rid], rid) for rid, _ in batch})
    positions = torch.cat([p for _, p in batch])
    recorder.keep_positions(positions)
    for column in range(COLUMNS):
        # the row's value encodes request, position and column, so misplaced rows show
        values = torch.cat([_rows(rid, p, column) for rid, p in batch])
        recorder.keep(column, values, None)
    recorder.mark_ready()
    recorder.end([(rid, int(p.numel())) for rid, p in batch])


def _rows(rid: str, positions: torch.Tensor, column: int) -> torch.Tensor:
    # Each row's first value (exact in bf16: an integer below 256, as position < 40, two
    # columns, three requests) names its request, position and column; the rest of the row
    # grows to twice that, so an fp8 row has more than one value to round.
    base = positions.to(torch.float32)[:, None] + 40 * column + 80 * (int(rid[1:]) - 1)
    return (base * (1 + torch.linspace(0, 1, HIDDEN))).to(STATE_DTYPE)


def _expected(rid: str, length: int) -> torch.Tensor:
    positions = torch.arange(length)
    return torch.stack([_rows(rid, positions, c) for c in range(COLUMNS)], dim=1)


def _read(path: str, length: int, store_dtype: str = BF16) -> torch.Tensor | Quantized:
    return map_request_file(path, RequestFile(length, COLUMNS, HIDDEN, store_dtype))


def test_a_request_file_is_rows_then_scales_from_an_8_byte_boundary():
    bf16 = RequestFile(5, COLUMNS, HIDDEN)
    assert (bf16.row_bytes, bf16.size) == (2 * 8 * 2, 5 * 32)
    fp8 = RequestFile(5, 3, 7, FP8)  # 105 bytes of e4m3 rows, scales from byte 112
    assert (fp8.row_bytes, fp8.scales_offset, fp8.size) == (21, 112, 112 + 5 * 3 * 4)


@pytest.mark.parametrize(("threads", "store_dtype"), [(1, BF16), (2, BF16), (2, FP8)])
def test_chunked_out_of_order_and_recomputed_rows_are_filed_by_position(
    tmp_path: Path, threads: int, store_dtype: str
) -> None:
    recorder = StateRecorder(
        num_columns=COLUMNS,
        hidden_size=HIDDEN,
        max_tokens=64,
        device=torch.device("cpu"),
        out_dir=tmp_path,
        filing_threads=threads,
        store_dtype=store_dtype,
    )
    lengths = {"r1": 40, "r2": 7, "r3": 5}
    try:
        # r1 over three forwards, r2 in one, r3 in two pieces that are not consecutive runs
        _forward(recorder, [("r1", torch.arange(0, 20)), ("r2", torch.arange(7))], lengths)
        _forward(
            recorder, [("r3", torch.tensor([0, 1, 3, 4])), ("r1", torch.arange(20, 30))], lengths
        )
        # r1 recomputed from 10 (a preemption), then finished; r3's last row; a step past r2
        _forward(
            recorder,
            [("r1", torch.arange(10, 40)), ("r3", torch.tensor([2])), ("r2", torch.tensor([7]))],
            lengths,
        )
        result = recorder.drain()
        stats, requests = result["stats"], result["requests"]
        assert stats["forwards"] == 3 and stats["requests"] == 3
        assert stats["overwritten_tokens"] == 20  # r1's positions 10..29, filed twice
        assert stats["beyond_prompt_tokens"] == 1
        # Each forward's requests by file key (here the request id), in batch order.
        assert stats["schedule"] == [
            [("r1", 20), ("r2", 7)],
            [("r3", 4), ("r1", 10)],
            [("r1", 30), ("r3", 1), ("r2", 1)],
        ]
        assert requests["r1"]["forwards"] == 3 and requests["r3"]["forwards"] == 2
        for rid, length in lengths.items():
            request = requests[rid]
            assert request["missing"] == 0 and request["file"].endswith(f"{rid}.bin")
            filed = _read(request["file"], length, store_dtype)
            if store_dtype == FP8:
                # Quantized per row by the filing thread: the bits of the whole request at once.
                values, scales = quantize_fp8(_expected(rid, length))
                assert filed.values.dtype == torch.float8_e4m3fn
                assert torch.equal(filed.values.view(torch.uint8), values.view(torch.uint8))
                assert torch.equal(filed.scales, scales)
            else:
                assert torch.equal(filed, _expected(rid, length))
        assert not list(tmp_path.glob("*.partial"))
    finally:
        recorder.close()


def test_an_unfinished_request_stays_partial_and_is_reported_missing(tmp_path: Path) -> None:
    recorder = StateRecorder(
        num_columns=COLUMNS,
        hidden_size=HIDDEN,
        max_tokens=16,
        device=torch.device("cpu"),
        out_dir=tmp_path,
        store_dtype=BF16,
    )
    try:
        _forward(recorder, [("r1", torch.arange(0, 6))], {"r1": 10})
        result = recorder.drain()
        assert result["requests"]["r1"]["missing"] == 4
        assert result["requests"]["r1"]["file"].endswith("r1.partial")
        with pytest.raises(RuntimeError, match="exceeds the capture buffer"):
            recorder.begin(17, {})
    finally:
        recorder.close()
    assert not list(tmp_path.iterdir())  # close() deletes what was never published
