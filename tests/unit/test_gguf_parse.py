"""A GGUF file's header, read by pdserve's own ``GGUFIndex``, says what the ``gguf``
package's reader says (every metadata value, every tensor's type, shape and bytes);
a broken or truncated file is a clear error. The metadata is parsed once per start
(``gguf_file.parsed_once``): the ``GGUFFile`` objects made inside share one parse, a
changed file is parsed again, and nothing is kept once the start is over."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from pdserve.runtime import gguf_file
from pdserve.runtime.gguf_file import GGUFError, GGUFFile, parsed_once


def write_gguf(path, arch: str = "llama") -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def parses(monkeypatch):
    """Counts the reader's parses."""
    count = [0]
    real = gguf_file.GGUFIndex

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf_file, "GGUFIndex", counting)
    return count


def write_every_kind(path) -> None:
    """A file with a value of every metadata type, arrays of each, and tensors stored as
    float32, float16 and a quantized type, past a non-default alignment."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_string("t.empty", "")
    writer.add_array("t.tokens", ["<s>", "Ġthe", "é", "", "✓✓"])
    writer.add_array("t.ints", [3, -1, 7])
    writer.add_array("t.floats", [0.5, 1e-5])
    writer.add_array("t.bools", [True, False])
    writer.add_tensor("a.f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("b.f16", rng.standard_normal((4, 8)).astype(np.float16))
    weights = rng.standard_normal((2, 64)).astype(np.float32)
    writer.add_tensor("c.q8", quantize(weights, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_index_reads_what_the_gguf_packages_reader_reads(tmp_path):
    path = tmp_path / "every.gguf"
    write_every_kind(path)
    ours, theirs = gguf_file.GGUFIndex(path), gguf.GGUFReader(str(path))
    expected = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert ours.fields == expected
    assert ours.fields["t.str"] == "héllo ✓" and ours.fields["t.u64"] == 2**63 + 5
    assert ours.fields["t.tokens"] == ["<s>", "Ġthe", "é", "", "✓✓"]
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.tensor_type, mine.shape, mine.n_bytes) == (ref.tensor_type, tuple(ref.shape.tolist()), ref.n_bytes)
        data = ours.data(mine)
        assert data.dtype == ref.data.dtype and data.shape == ref.data.shape
        assert np.array_equal(data, ref.data)


def test_a_truncated_or_mangled_header_is_a_clear_error(tmp_path):
    path = tmp_path / "every.gguf"
    write_every_kind(path)
    whole = path.read_bytes()
    tensors = gguf_file.GGUFIndex(path).tensors
    header_end, data_end = tensors[0].offset, tensors[-1].offset + tensors[-1].n_bytes
    broken = tmp_path / "broken.gguf"
    for cut in (0, 3, 10, 30, header_end // 3, header_end // 2, header_end - 1, data_end - 1):
        broken.write_bytes(whole[:cut])
        with pytest.raises(GGUFError, match="not a readable GGUF file"):
            GGUFFile(broken).field("general.architecture")
    version_2_big_endian = whole[:4] + (3).to_bytes(4, "big") + whole[8:]
    broken.write_bytes(version_2_big_endian)
    with pytest.raises(GGUFError, match="GGUF version"):
        GGUFFile(broken).field("general.architecture")
    key = whole.index(b"t.str") + len(b"t.str")  # its value's type: 8 (string) -> 99
    broken.write_bytes(whole[:key] + (99).to_bytes(4, "little") + whole[key + 4:])
    with pytest.raises(GGUFError, match="unknown metadata value type 99"):
        GGUFFile(broken).field("general.architecture")


def test_files_made_inside_share_one_parse_and_nothing_stays_after(tmp_path, parses):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    with parsed_once():
        with parsed_once():  # nested: the outer one's
            assert GGUFFile(path).field("llama.block_count") == 2
        assert GGUFFile(path).field("general.architecture") == "llama"
        assert parses[0] == 1
    assert gguf_file._shared is None
    GGUFFile(path).field("llama.block_count")
    GGUFFile(path).field("llama.block_count")
    assert parses[0] == 3  # outside, each file object parses its own


def test_a_file_changed_between_two_reads_is_parsed_again(tmp_path, parses):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama")
    with parsed_once():
        assert GGUFFile(path).field("general.architecture") == "llama"
        write_gguf(path, "qwen2")
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a coarse clock
        assert GGUFFile(path).field("general.architecture") == "qwen2"
    assert parses[0] == 2


def test_a_missing_or_broken_file_is_still_a_clear_error_inside(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    with parsed_once():
        with pytest.raises(GGUFError, match="no such GGUF file"):
            GGUFFile(tmp_path / "missing.gguf").field("general.architecture")
        with pytest.raises(GGUFError, match="not a readable GGUF file"):
            GGUFFile(broken).field("general.architecture")
    assert gguf_file._shared is None
