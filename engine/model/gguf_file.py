"""A GGUF file checked before transformers or the gguf package read it: the magic, the version, the whole
header (metadata and tensor infos) inside the file, and the tensor data section no longer than the file.

    header = read_gguf_header(path)   # GGUFHeader, or UserError: not a GGUF file / truncated / corrupt

transformers' GGUF loader reads a cut file with struct.unpack or numpy reshapes and fails with a traceback
that says nothing of the file; this says what is wrong with it in one line. The layout (GGUF versions 2
and 3, little-endian): "GGUF", uint32 version, uint64 tensor count, uint64 metadata count, the metadata
(key, value type, value), the tensor infos (name, dimensions, type, offset), padding to the alignment,
then the tensor data.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# metadata value types: fixed-size ones by their struct code; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The bytes are not a complete GGUF file; `truncated` when they end before the file does."""

    def __init__(self, message: str, truncated: bool = False):
        super().__init__(message)
        self.truncated = truncated


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict  # scalar and string values (arrays are skipped)
    tensor_count: int
    data_end: int  # bytes the file needs: the data section's start plus its tensors' extent

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None


class _Cursor:
    """Reads little-endian values from a buffer; reading past its end is a truncated file."""

    def __init__(self, buf):
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise GGUFFormatError(f"its header ends early (at byte {self.size}, while reading byte {start + n})",
                                  truncated=True)
        self.pos += n
        return start

    def value(self, code: str):
        return struct.unpack_from("<" + code, self.buf, self.take(struct.calcsize(code)))[0]

    def string(self) -> str:
        n = self.value("Q")
        return bytes(self.buf[self.take(n) : self.pos]).decode("utf-8", errors="replace")


def _skip_array(cur: _Cursor) -> None:
    item_type, count = cur.value("I"), cur.value("Q")
    if item_type in _SCALARS:
        cur.take(count * struct.calcsize(_SCALARS[item_type]))
    elif item_type == _STRING:
        for _ in range(count):
            cur.take(cur.value("Q"))
    elif item_type == _ARRAY:
        for _ in range(count):
            _skip_array(cur)
    else:
        raise GGUFFormatError(f"its metadata holds an unknown value type {item_type} (at byte {cur.pos - 12})")


def _metadata_value(cur: _Cursor):
    value_type = cur.value("I")
    if value_type in _SCALARS:
        return cur.value(_SCALARS[value_type])
    if value_type == _STRING:
        return cur.string()
    if value_type == _ARRAY:
        _skip_array(cur)
        return None
    raise GGUFFormatError(f"its metadata holds an unknown value type {value_type} (at byte {cur.pos - 4})")


def _tensor_bytes(dims: list[int], ggml_type: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFFormatError(f"a tensor has an unknown type {ggml_type}") from None
    n = 1
    for d in dims:
        n *= d
    return n // block * size


def parse_gguf_header(buf) -> GGUFHeader:
    """The header of the GGUF bytes `buf` (bytes or mmap), checked to lie inside it; GGUFFormatError if not."""
    if len(buf) < len(MAGIC) and MAGIC.startswith(bytes(buf)) and len(buf):
        raise GGUFFormatError("it ends inside the GGUF magic", truncated=True)
    if bytes(buf[: len(MAGIC)]) != MAGIC:
        raise GGUFFormatError("it does not start with the GGUF magic bytes")
    cur = _Cursor(buf)
    cur.take(len(MAGIC))
    version = cur.value("I")
    if version not in VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} is not supported (versions {', '.join(map(str, VERSIONS))})")
    tensor_count, kv_count = cur.value("Q"), cur.value("Q")
    metadata = {}
    for _ in range(kv_count):
        key = cur.string()
        metadata[key] = _metadata_value(cur)
    extent = 0
    for _ in range(tensor_count):
        cur.string()
        n_dims = cur.value("I")
        dims = [cur.value("Q") for _ in range(n_dims)]
        ggml_type, offset = cur.value("I"), cur.value("Q")
        extent = max(extent, offset + _tensor_bytes(dims, ggml_type))
    alignment = metadata.get("general.alignment") or _DEFAULT_ALIGNMENT
    if not isinstance(alignment, int) or alignment < 1:
        raise GGUFFormatError(f"its general.alignment is {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    return GGUFHeader(version, metadata, tensor_count, data_start + extent)


def check_gguf_bytes(buf) -> GGUFHeader:
    """parse_gguf_header, and the tensor data no longer than the bytes."""
    header = parse_gguf_header(buf)
    if header.data_end > len(buf):
        raise GGUFFormatError(f"its {header.tensor_count} tensors need {header.data_end:,} bytes, the file has "
                              f"{len(buf):,}", truncated=True)
    return header


@functools.lru_cache(maxsize=16)
def _read_cached(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return check_gguf_bytes(buf)


def has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def read_gguf_header(path: str | Path, name: str | None = None) -> GGUFHeader:
    """The checked header of the GGUF file at `path` (`name`: how the user gave it); UserError in one line
    saying that it is truncated, corrupt or not a GGUF file."""
    name = name or str(path)
    try:
        st = os.stat(path)
        if st.st_size == 0:
            raise UserError(f"{name} is empty, not a GGUF file")
        return _read_cached(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    except GGUFFormatError as e:
        if e.truncated:
            raise UserError(f"{name} is a truncated GGUF file ({st.st_size:,} bytes): {e}; download or write "
                            "it again") from None
        raise UserError(f"{name} is not a valid GGUF file: {e}") from None
    except OSError as e:
        raise UserError(f"cannot read {name}: {e.strerror or e}") from None
