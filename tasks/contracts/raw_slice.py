"""Records read at their offsets, and byte ranges of them, in one copy where a C++ compiler is
at hand.

``read_records_at`` reads framed TFRecords at given offsets of shard files (CRCs checked):
``raw_slice.cc``'s positional-read op where it is built, else :func:`tasks.tfrecord.read_framed_at`
through ``tf.numpy_function``: the same bytes in the same order, or the same refusal. For a
raw batch, :meth:`RangeReadSchema.read_at` reads the pixels of such records straight into
the batch and their labels beside it, framing and CRCs checked alike.

Stock TensorFlow reads bytes at an offset in two copies: ``decode_raw`` copies each record's
head into a tensor, then a slice copies the part wanted (a raw record's pixels start after a
header). ``raw_slice.cc`` beside this module is one op that copies the range itself. It
is compiled against the installed TensorFlow, once per source and TensorFlow version (``make
install`` builds it; a read builds it when missing), into the virtual environment beside it.
Where it cannot be built, the stock ops give the same bytes, and the process says so once,
naming the cause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.runtime.layout import shared_root
from tasks.schema import IMAGE_KEY, LABEL_KEY, RawLayout, RecordSchema, _bytes_match, raw_layout
from tasks.tfrecord import read_framed_at

SOURCE = Path(__file__).with_name("raw_slice.cc")
OPS_DIR = Path(".shardflow") / "ops"  # outside a virtual environment
VENV_OPS_DIR = "shardflow-ops"
COMPILER_ENV = "CXX"  # the C++ compiler; g++ where unset
BUILD_TIMEOUT_S = 300
_STOCK_ONLY = False  # set by stock_ops(): the bench times the stock path beside the op


def read_records_at(files: Sequence[str], file_ids: Any, offsets: Any, sizes: Any) -> Any:
    """string [B]: the data of the record framed at ``offsets[i]`` (``sizes[i]`` bytes with
    header and footer) of ``files[file_ids[i]]``, CRCs checked; int32/int64 [B] tensors in."""
    import tensorflow as tf

    op = None if _STOCK_ONLY else loaded_op()
    if op is not None:
        return op.shardflow_read_records_at(file_ids, offsets, sizes, paths=list(files))
    reader = FramedReader(files)
    # Stateless as the op is: the same ids read the same bytes of immutable shards, and a
    # stateful op would switch off prefetch under op determinism (train.deterministic).
    records = tf.numpy_function(reader, [file_ids, offsets, sizes], tf.string, stateful=False)
    return tf.ensure_shape(records, file_ids.shape)


class FramedReader:
    """The stock path of :func:`read_records_at`: ``os.pread`` on files opened once."""

    def __init__(self, files: Sequence[str]) -> None:
        self.files = tuple(files)
        self._fds: dict[int, int] = {}

    def __call__(self, file_ids: Any, offsets: Any, sizes: Any) -> Any:
        import numpy as np

        out = np.empty(len(file_ids), dtype=object)
        for i, (file_id, offset, size) in enumerate(zip(file_ids, offsets, sizes, strict=True)):
            where = f"{self.files[file_id]} at byte {offset}"
            out[i] = read_framed_at(self._fd(int(file_id)), int(offset), int(size), where)
        return out

    def _fd(self, file_id: int) -> int:
        fd = self._fds.get(file_id)
        if fd is None:
            fd = self._fds[file_id] = os.open(self.files[file_id], os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def __del__(self) -> None:
        for fd in self._fds.values():
            os.close(fd)


def record_ranges(records: Any, ranges: Sequence[tuple[int, int]]) -> list[Any]:
    """uint8 [B, length] for each ``(offset, length)`` of ``ranges``, from string [B] ``records``.

    Row ``i`` holds bytes ``offset .. offset + length`` of record ``i``, zeros past a short
    record's end: ``decode_raw(records, fixed_length=...)`` sliced, whichever path reads it.
    """
    import tensorflow as tf

    op = None if _STOCK_ONLY else loaded_op()
    if op is not None:
        return [op.shardflow_decode_raw_at(records, offset=o, length=n) for o, n in ranges]
    end = max(offset + length for offset, length in ranges)
    head = tf.io.decode_raw(records, tf.uint8, fixed_length=end)
    return [head[:, offset : offset + length] for offset, length in ranges]


class RecordBytes:
    """A batch of serialized records as uint8 [B, n] rows whose columns are read when indexed:
    ``[:, a:b]`` and ``[:, i]`` read those bytes of every record (:func:`record_ranges`),
    what ``decode_raw(records, fixed_length=n)`` sliced alike holds."""

    def __init__(self, records: Any, length: int) -> None:
        self.records, self.length = records, length

    def __getitem__(self, key: tuple[slice, slice | int]) -> Any:
        rows, columns = key
        if rows != slice(None):
            raise IndexError("RecordBytes reads every record of the batch: index rows with `:`")
        if isinstance(columns, int):
            return record_ranges(self.records, [(columns, 1)])[0][:, 0]
        start, stop, step = columns.indices(self.length)
        if step != 1:
            raise IndexError("RecordBytes reads contiguous byte ranges only")
        return record_ranges(self.records, [(start, stop - start)])[0]


@dataclass(frozen=True)
class RangeReadSchema(RecordSchema):
    """The record schema whose raw batches take the pixels straight from their offset in
    each record (:class:`RecordBytes`) where :meth:`RecordSchema.raw_record_bytes` copies
    every record's head first: the same tensors, one copy fewer. The reader's own; the
    schema module itself is part of the preprocessing version, which a read must not move."""

    def raw_record_bytes(self, serialized: Any) -> tuple[RawLayout, Any, Any]:
        import tensorflow as tf

        layout = raw_layout(self.height * self.width * self.channels)
        record_bytes = RecordBytes(serialized, layout.length)
        proven = tf.logical_and(
            _bytes_match(record_bytes[:, : layout.image_offset], layout.head, layout.head_mask),
            _bytes_match(record_bytes[:, layout.tail_offset :], layout.tail, layout.tail_mask),
        )
        return layout, record_bytes, proven

    def read_at(self, files: Sequence[str], file_ids: Any, offsets: Any, sizes: Any) -> Any:
        """``(images, labels)`` of the records :func:`read_records_at` reads, uint8 [B, H, W, C]
        and int32 [B]: each record's pixels read from its file straight into its row of the
        batch where every record of the batch proves the layout, else the records read and
        parsed (:meth:`RecordSchema.parse_batch`). What the records parsed hold, either way."""
        import tensorflow as tf

        layout = raw_layout(self.height * self.width * self.channels)
        images, labels, proven = read_raw_at(files, layout, file_ids, offsets, sizes)
        shape = (file_ids.shape[0], *self.image_shape)

        def parsed() -> tuple[Any, Any]:
            records = read_records_at(files, file_ids, offsets, sizes)
            features = self.parse_batch(records, metadata=False)
            return features[IMAGE_KEY], features[LABEL_KEY]

        images, labels = tf.cond(proven, lambda: (tf.reshape(images, shape), labels), parsed)
        return tf.ensure_shape(images, shape), labels


def read_raw_at(
    files: Sequence[str], layout: RawLayout, file_ids: Any, offsets: Any, sizes: Any
) -> tuple[Any, Any, Any]:
    """The op's read of :func:`read_records_at`'s records laid out as ``layout``: uint8
    [B, image bytes] (each record's pixels), int32 [B] labels and a scalar bool, true where
    every record proved the layout (rows of records that did not are not theirs)."""
    return tuple(
        loaded_op().shardflow_read_raw_at(
            file_ids,
            offsets,
            sizes,
            paths=list(files),
            image_bytes=layout.image_bytes,
            label_offset=layout.label_offset,
            head=layout.head,
            head_mask=layout.head_mask,
            tail=layout.tail,
            tail_mask=layout.tail_mask,
        )
    )


def range_read(schema: RecordSchema) -> RecordSchema:
    """``schema`` read with :class:`RangeReadSchema` where its shards are raw and the op is
    built, else as it is (the stock ops cut a record's head once, where each range would copy
    it again; encoded images are parsed, never cut)."""
    if schema.encoding != "raw" or _STOCK_ONLY or loaded_op() is None:
        return schema
    return RangeReadSchema(**dataclasses.asdict(schema))


@contextlib.contextmanager
def stock_ops() -> Iterator[None]:
    """Pipelines built inside read through the stock ops, as where the op cannot be built."""
    global _STOCK_ONLY
    before, _STOCK_ONLY = _STOCK_ONLY, True
    try:
        yield
    finally:
        _STOCK_ONLY = before


@functools.cache
def loaded_op() -> Any:
    """The loaded op module, or None (said once on stderr, with the cause) where it cannot be."""
    import tensorflow as tf

    library, why = built_library()
    if library is not None:
        try:
            return tf.load_op_library(str(library))
        except Exception as error:  # built elsewhere, or for another TensorFlow build
            why = f"{library} does not load ({error}); remove it to build it again"
    print(
        f"shardflow: raw shards are read with stock TensorFlow ops, one more copy per image: {why}",
        file=sys.stderr,
    )
    return None


def built_library(ops_dir: Path | None = None) -> tuple[Path | None, str]:
    """The op's shared library for this source and TensorFlow, built unless it is there.

    Returns ``(path, "")``, or ``(None, why)`` where no compiler is found or the build failed;
    a failed build is remembered beside it (``.failed``), so that every process does not try
    again: a new source or TensorFlow version, or removing the file, tries again.
    """
    if not SOURCE.is_file():  # an install that left the op's source out
        return None, f"the op's source {SOURCE} is missing"
    target = library_path(ops_dir)
    failed = target.with_suffix(".failed")
    if target.exists():
        return target, ""
    if failed.exists():
        return None, f"{failed.read_text().strip()} (remove {failed} to try again)"
    compiler = shutil.which(os.environ.get(COMPILER_ENV) or "g++")
    if compiler is None:
        name = os.environ.get(COMPILER_ENV) or "g++"
        return None, f"no C++ compiler ({COMPILER_ENV}={name} is not on PATH)"
    try:
        why = compile_library(compiler, target)
        if why:
            failed.write_text(why + "\n")
    except OSError as error:  # a read-only environment: nowhere to keep the build
        return None, f"cannot build into {target.parent}: {error}"
    return (None, why) if why else (target, "")


def library_path(ops_dir: Path | None = None) -> Path:
    """Where this source, built for the installed TensorFlow, lives: a new source or
    TensorFlow version is a new file."""
    import tensorflow as tf

    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(" ".join(tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()).encode())
    base = ops_dir or default_ops_dir()
    return base / f"raw_slice-tf{tf.__version__}-{key.hexdigest()[:16]}.so"


def default_ops_dir() -> Path:
    """Beside the TensorFlow it is built against: in the virtual environment (``make install``'s
    ``.venv``, shared by every copy of the project it runs), else in the repository."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / VENV_OPS_DIR
    return shared_root(Path(__file__).resolve().parents[2]) / OPS_DIR


def compile_library(compiler: str, target: Path) -> str:
    """Compile :data:`SOURCE` into ``target`` (atomically); the failure's cause, or ""."""
    import tensorflow as tf

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    command = [compiler, "-std=c++17", "-shared", "-fPIC", "-O2", "-w", str(SOURCE)]
    command += ["-o", str(partial), *tf.sysconfig.get_compile_flags()]
    command += tf.sysconfig.get_link_flags()
    print(f"shardflow: building the raw-record op ({target.name})", file=sys.stderr)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        partial.unlink(missing_ok=True)
        return f"{compiler} took over {BUILD_TIMEOUT_S} s to build {SOURCE.name}"
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{compiler} failed to build {SOURCE.name} (exit {done.returncode}): {last}"
    os.replace(partial, target)
    return ""


def main() -> None:
    """``python -m tasks.contracts.raw_slice``: build the op now (``make install``); never fails."""
    library, why = built_library()
    print(f"raw-record op: {library}" if library else f"raw-record op not built: {why}")


if __name__ == "__main__":
    main()
