"""TensorBoard event files without TensorBoard: scalar summaries written by hand.

An event file is a TFRecord stream (per record: uint64 length, masked CRC-32C of the length,
the bytes, masked CRC-32C of the bytes) of serialized `Event` protocol buffers:

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

Only these fields are written, so the encoder is a few lines. `read_scalars` parses the same
subset back (checking every CRC), for tests and for tools that lack TensorBoard.
"""

from __future__ import annotations

import os
import socket
import struct
import time


def _crc32c_table() -> list:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf encodes it
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def encode_event(wall_time: float, step: int, *, file_version: str | None = None, scalars: dict | None = None) -> bytes:
    out = bytes([1 << 3 | 1]) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step)
    if file_version is not None:
        out += _field_bytes(3, file_version.encode())
    if scalars:
        summary = b"".join(
            _field_bytes(1, _field_bytes(1, tag.encode()) + bytes([2 << 3 | 5]) + struct.pack("<f", float(value)))
            for tag, value in scalars.items())
        out += _field_bytes(5, summary)
    return out


def frame_record(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


class EventWriter:
    """Append scalar summaries to DIR/events.out.tfevents.<time>.<host>."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        now = time.time()
        self.path = os.path.join(directory, f"events.out.tfevents.{int(now)}.{socket.gethostname()}")
        self._file = open(self.path, "ab")
        self._file.write(frame_record(encode_event(now, 0, file_version="brain.Event:2")))
        self._file.flush()

    def scalars(self, step: int, values: dict, wall_time: float | None = None) -> None:
        clean = {tag: v for tag, v in values.items() if v is not None}
        if clean:
            self._file.write(frame_record(encode_event(wall_time or time.time(), step, scalars=clean)))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


# -- reading back ----------------------------------------------------------------------------------

def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _fields(buf: bytes):
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        elif wire == 2:
            length, i = _read_varint(buf, i)
            value, i = buf[i:i + length], i + length
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, value


def read_records(path: str) -> list:
    records = []
    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i < len(data):
        header = data[i:i + 8]
        (length,) = struct.unpack("<Q", header)
        (crc,) = struct.unpack("<I", data[i + 8:i + 12])
        if crc != masked_crc32c(header):
            raise ValueError(f"{path}: bad length CRC at offset {i}")
        body = data[i + 12:i + 12 + length]
        (crc,) = struct.unpack("<I", data[i + 12 + length:i + 16 + length])
        if crc != masked_crc32c(body):
            raise ValueError(f"{path}: bad data CRC at offset {i}")
        records.append(body)
        i += 16 + length
    return records


def read_scalars(path: str) -> tuple[str | None, list]:
    """(file_version, [(step, tag, value), ...]) from an event file."""
    version, scalars = None, []
    for record in read_records(path):
        step = 0
        for number, value in _fields(record):
            if number == 2:
                step = value
            elif number == 3:
                version = value.decode()
            elif number == 5:
                for n, v in _fields(value):
                    if n != 1:
                        continue
                    tag, number_value = None, None
                    for vn, vv in _fields(v):
                        if vn == 1:
                            tag = vv.decode()
                        elif vn == 2:
                            (number_value,) = struct.unpack("<f", vv)
                    scalars.append((step, tag, number_value))
    return version, scalars
