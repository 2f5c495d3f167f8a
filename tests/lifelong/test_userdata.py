import pytest

from ecru.errors import EcruError
from ecru.lifelong.userdata import Record, read_records

BOM = b"\xef\xbb\xbf"  # Excel's "CSV UTF-8" starts the file with it
EXPECTED = [Record("hello, world", "greet"), Record("bye", "farewell")]
CSV = b'text,label\n"hello, world",greet\nbye,farewell\n'
JSONL = b'{"text": "hello, world", "label": "greet"}\n{"text": "bye", "label": "farewell"}\n'


@pytest.mark.parametrize(
    "name, data",
    [("a.csv", CSV), ("a.jsonl", JSONL), ("a.txt", JSONL), ("a.txt", CSV)],
    ids=["csv", "jsonl", "txt-jsonl", "txt-csv"],
)
def test_a_byte_order_mark_is_read_as_if_absent(tmp_path, name, data):
    path = tmp_path / name  # .txt: JSONL or CSV is told by the first character, after the BOM
    path.write_bytes(BOM + data)
    assert read_records(path, labels=True) == EXPECTED


def test_invalid_utf8_is_still_one_line(tmp_path):
    path = tmp_path / "a.csv"
    path.write_bytes(BOM + CSV + b"caf\xe9,x\n")
    with pytest.raises(EcruError, match="cannot read it as UTF-8") as info:
        read_records(path, labels=True)
    assert "\n" not in str(info.value)


def test_a_jsonl_file_without_its_suffix_may_start_with_blank_space(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"\n  " + JSONL)
    assert read_records(path, labels=True) == EXPECTED
