"""Reads the history of an offline wandb run from its ``run-*.wandb`` file, for the tests.

The file is wandb's transaction log: a 7-byte header (``:W&B``, a 2-byte magic, a version byte),
then LevelDB-log records in 32 KiB blocks (a 4-byte CRC, a 2-byte little-endian length, a type:
1 whole, 2 first, 3 middle, 4 last piece), each payload a ``wandb_internal_pb2.Record``.
"""

import json
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7


def _payloads(data: bytes):
    assert data[:4] == b":W&B", "not a wandb transaction log"
    pos, pieces = HEADER, []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        if kind == 0 and length == 0:
            pos += left
            continue
        piece = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        pieces.append(piece)
        if kind in (1, 4):
            yield b"".join(pieces)
            pieces = []


def history(run_dir: Path) -> list[dict]:
    """The logged history rows of the offline run in ``run_dir`` (``offline-run-*``), each a
    dict of key to value (``_step`` included)."""
    (log,) = Path(run_dir).glob("run-*.wandb")
    rows = []
    for payload in _payloads(log.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows
