"""TFDS metadata beside the shards, so ``tfds.builder_from_directory(shards_dir)`` loads them.

TensorFlow Datasets restores a dataset without its generation code from ``dataset_info.json``
(name, version, splits with their shard lengths and file name template) and ``features.json``
(how each feature decodes), plus ``label.labels.txt`` (the class names, one a line, the file
TFDS's ``ClassLabel`` keeps them in). Everything comes from the manifest, nothing from TFDS
itself (a test loads the result with TFDS), so the shard stage needs no extra dependency.

- ``image``: a ``Tensor`` of uint8 with ``bytes`` encoding for ``raw`` shards (TFDS runs the
  same ``decode_raw`` + reshape as ``read_split``), an ``Image`` feature for ``jpeg``/``png``.
- ``label``: a ``ClassLabel`` with the manifest's class names. ``content_hash`` and
  ``source``: ``Text``. ``as_supervised=True`` yields ``(image, label)``.
- File names: the splits declare ``filepathTemplate`` ``{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}``,
  which is how the shard stage names files (``train.tfrecord-00000-of-00004``).

GZIP shards get no TFDS metadata (any left from an earlier run is removed): TFDS opens
``tfrecord`` files with ``tf.data.TFRecordDataset`` and no compression type, so it cannot read
them. ``read_split`` and ``tasks.contracts.numpy_reader`` read them. Neither does a shard set of
several
generations (``shard.mode: append``): its files live in ``gen-NNNNN/`` folders that one
``filepathTemplate`` cannot name; `make compact` folds them back into one TFDS-readable set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.contracts.content import check_class_names
from tasks.contracts.manifest import ShardManifest
from tasks.runtime.atomic import write_json, write_text
from tasks.schema import HASH_KEY, IMAGE_KEY, LABEL_KEY, SOURCE_KEY

DATASET_INFO_NAME = "dataset_info.json"
FEATURES_NAME = "features.json"
LABELS_NAME = f"{LABEL_KEY}.labels.txt"
TFDS_FILE_NAMES = (DATASET_INFO_NAME, FEATURES_NAME, LABELS_NAME)
TFDS_NAME = "shardflow"
# tasks.shard.planning.shard_name writes exactly these names (a test holds them together).
FILE_TEMPLATE = "{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"
FEATURE_CLASSES = "tensorflow_datasets.core.features"


def _shape(manifest: ShardManifest) -> dict[str, list[str]]:
    # int64 fields are strings in protobuf JSON, as TFDS writes them.
    return {"dimensions": [str(d) for d in manifest.record_schema.image_shape]}


def image_feature(manifest: ShardManifest) -> dict[str, Any]:
    """The ``image`` feature: a raw uint8 tensor or an encoded image, at the schema's shape."""
    schema = manifest.record_schema
    if schema.encoding == "raw":
        return {
            "pythonClassName": f"{FEATURE_CLASSES}.tensor_feature.Tensor",
            "tensor": {"dtype": "uint8", "encoding": "bytes", "shape": _shape(manifest)},
        }
    return {
        "pythonClassName": f"{FEATURE_CLASSES}.image_feature.Image",
        "image": {"dtype": "uint8", "encodingFormat": schema.encoding, "shape": _shape(manifest)},
    }


def features_json(manifest: ShardManifest) -> dict[str, Any]:
    """``features.json``: every feature the records hold, as TFDS's FeaturesDict proto."""
    text = {"pythonClassName": f"{FEATURE_CLASSES}.text_feature.Text", "text": {}}
    label = {
        "pythonClassName": f"{FEATURE_CLASSES}.class_label_feature.ClassLabel",
        "classLabel": {"numClasses": str(len(manifest.classes))},
    }
    return {
        "pythonClassName": f"{FEATURE_CLASSES}.features_dict.FeaturesDict",
        "featuresDict": {
            "features": {
                IMAGE_KEY: image_feature(manifest),
                LABEL_KEY: label,
                HASH_KEY: text,
                SOURCE_KEY: text,
            }
        },
    }


def dataset_info_json(manifest: ShardManifest) -> dict[str, Any]:
    """``dataset_info.json``: name, version, supervised keys and the non-empty splits."""
    schema = manifest.record_schema
    splits = [
        {
            "name": name,
            "filepathTemplate": FILE_TEMPLATE,
            "numBytes": str(sum(shard.bytes for shard in info.shards)),
            "shardLengths": [str(shard.num_records) for shard in info.shards],
        }
        for name, info in manifest.splits.items()
        if info.shards
    ]
    return {
        "name": TFDS_NAME,
        "version": f"{schema.version}.0.0",  # the record schema version
        "description": (
            f"Shardflow shard set {manifest.fingerprint}: {len(manifest.classes)} classes, "
            f"{schema.encoding} images {schema.height}x{schema.width} ({manifest.resize}). "
            "manifest.json in this folder is the source of truth."
        ),
        "fileFormat": "tfrecord",
        "supervisedKeys": {
            "tuple": {"items": [{"featureKey": IMAGE_KEY}, {"featureKey": LABEL_KEY}]}
        },
        "splits": splits,
    }


def labels_text(manifest: ShardManifest) -> str:
    """Class names one a line, in label order (what ``ClassLabel(names_file=...)`` reads)."""
    check_class_names(manifest.classes, "TFDS's label.labels.txt", "it holds one a line")
    return "".join(f"{name}\n" for name in manifest.classes)


def tfds_files(manifest: ShardManifest) -> tuple[str, ...]:
    """The TFDS files a shard set carries: none for GZIP shards or several generations
    (TFDS reads neither), else its three."""
    if manifest.compression != "none" or len(manifest.generations) > 1:
        return ()
    return TFDS_FILE_NAMES


def write_tfds_metadata(manifest: ShardManifest, shards_dir: Path) -> None:
    """Write (or, for GZIP shards, remove) the TFDS files; each atomic, same manifest same bytes."""
    shards_dir = Path(shards_dir)
    if not tfds_files(manifest):
        for name in TFDS_FILE_NAMES:
            (shards_dir / name).unlink(missing_ok=True)
        return
    write_json(shards_dir / FEATURES_NAME, features_json(manifest))
    write_text(shards_dir / LABELS_NAME, labels_text(manifest))
    write_json(shards_dir / DATASET_INFO_NAME, dataset_info_json(manifest))
