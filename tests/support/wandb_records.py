"""Read the records of an offline W&B run file (`run-<id>.wandb`) with no network.

The file is a 7-byte header (":W&B", magic 0xBEE1, version 0) followed by the
leveldb log format: 32 KiB blocks of chunks, each chunk a 7-byte header (crc32,
length, type: 1 full, 2 first, 3 middle, 4 last) and its data; a block tail shorter
than a chunk header is zero padding. Each reassembled record is a protobuf
`wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

from runs import wait_until

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def raw_records(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1 and version == 0, (ident, magic, version)
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            break  # zero tail of a file still being written
        if pos + HEADER + length > len(data):
            break  # a chunk the writer has not finished
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            records.append(pending + chunk)
            pending = b""
    return records


def finished_records(path: Path, timeout: float = 60.0) -> list:
    """The parsed records of a finished run file. `wandb.finish()` can return before the
    W&B service has written the file's tail (seen with wandb 0.31 under load: a file cut
    at its first 32 KiB block), so this waits until the last record is the run's `exit`."""
    records = []

    def ends_in_exit() -> bool:
        records[:] = [parsed(blob) for blob in raw_records(path)]
        return bool(records) and records[-1].WhichOneof("record_type") == "exit"

    wait_until(ends_in_exit, timeout, f"an exit record at the end of {path} after wandb.finish()", every=0.1)
    return records


def parsed(blob: bytes):
    record = wandb_internal_pb2.Record()
    record.ParseFromString(blob)
    return record


def read_run(run_dir: Path) -> dict:
    """history rows (dicts of key -> decoded JSON value), summary and config updates, metric definitions."""
    (path,) = Path(run_dir).glob("*.wandb")
    out = {"history": [], "summary": {}, "metrics": {}, "config": {}}
    for record in finished_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            out["history"].append(row)
        elif kind == "summary":
            for item in record.summary.update:
                key = item.key or "/".join(item.nested_key)
                out["summary"][key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                key = item.key or "/".join(item.nested_key)
                out["config"][key] = json.loads(item.value_json)
        elif kind == "metric":
            out["metrics"][record.metric.name or record.metric.glob_name] = record.metric
    return out
