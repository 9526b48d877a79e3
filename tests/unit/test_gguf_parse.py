"""A GGUF file's metadata is parsed once per start (``gguf_file.parsed_once``): the
``GGUFFile`` objects made inside share one parse, a changed file is parsed again, and
nothing is kept once the start is over."""

from __future__ import annotations

import os

import gguf
import pytest

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
    real = gguf.GGUFReader

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    return count


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
