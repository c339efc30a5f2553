"""tiered finetune's data: every format, EOS and packing, chat masking, eval split, the seeded
resumable order, and the errors each bad input gives (file and line named)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from finetune_support import write_jsonl, write_model

from tiered.errors import ConfigError
from tiered.finetune import ByteTokenizer, PackedBatches, load_documents, pack, split_eval, tokenizer_for
from tiered.finetune.data_sources import IGNORE_INDEX

EOS = 256


@pytest.fixture
def tok(tmp_path: Path):  # type: ignore[no-untyped-def]
    return tokenizer_for(write_model(tmp_path / "m"), 300)


def docs_of(path: Path, tok, **kw):  # type: ignore[no-untyped-def]
    return load_documents(path, tok, vocab_size=300, eos_id=tok.eos_token_id, **kw)


# ---- formats -----------------------------------------------------------------------------------
def test_text_file_is_one_document_ending_with_eos(tmp_path: Path, tok) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "a.txt"
    f.write_text("héllo\nworld")
    (d,) = docs_of(f, tok)
    assert tok.eos_token_id == EOS
    assert list(d.ids) == [*"héllo\nworld".encode(), EOS] and d.labels == d.ids


def test_byte_tokenizer_takes_eos_from_the_model_config(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("ab")
    (d,) = load_documents(f, ByteTokenizer(256), vocab_size=256, eos_id=2)
    assert list(d.ids) == [97, 98, 2]


def test_jsonl_text_rows_and_text_field(tmp_path: Path, tok) -> None:  # type: ignore[no-untyped-def]
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "ab"}, {"text": "c", "other": 1}])
    assert [list(d.ids) for d in docs_of(f, tok)] == [[97, 98, EOS], [99, EOS]]
    g = write_jsonl(tmp_path / "e.jsonl", [{"body": "xy"}])
    assert [list(d.ids) for d in docs_of(g, tok, text_field="body")] == [[120, 121, EOS]]


def test_folder_reads_files_sorted_and_skips_hidden(tmp_path: Path, tok) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("B")
    (d / "a.txt").write_text("A")
    write_jsonl(d / "sub" / "c.jsonl", [{"text": "C"}])
    (d / ".hidden.txt").write_text("H")
    (d / "notes.csv").write_text("x,y")
    got = [bytes(x.ids[:-1]).decode() for x in docs_of(d, tok)]
    assert got == ["A", "B", "C"]


def test_json_array_file(tmp_path: Path, tok) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "d.json"
    f.write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=1))
    assert [list(d.ids) for d in docs_of(f, tok)] == [[97, EOS], [98, EOS]]
    f.write_text(json.dumps([{"text": "a"}, {"body": "b"}], indent=1))
    with pytest.raises(ConfigError, match=r"d\.json row 1: row has no 'text' field"):
        docs_of(f, tok)


def test_folder_with_a_saved_dataset_reads_it_as_one_source(tmp_path: Path, tok) -> None:  # type: ignore[no-untyped-def]
    datasets = pytest.importorskip("datasets")
    d = tmp_path / "data"
    d.mkdir()
    datasets.Dataset.from_dict({"text": ["x", "y"]}).save_to_disk(str(d / "b_saved"))
    (d / "a.txt").write_text("A")
    (d / "c.txt").write_text("C")
    assert [bytes(x.ids[:-1]).decode() for x in docs_of(d, tok)] == ["A", "x", "y", "C"]


def test_saved_dataset_and_parquet(tmp_path: Path, tok) -> None:  # type: ignore[no-untyped-def]
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": ["one", "two"], "n": [1, 2]})
    ds.save_to_disk(str(tmp_path / "saved"))
    assert [bytes(x.ids[:-1]).decode() for x in docs_of(tmp_path / "saved", tok)] == ["one", "two"]
    ds.to_parquet(str(tmp_path / "d.parquet"))
    assert [bytes(x.ids[:-1]).decode() for x in docs_of(tmp_path / "d.parquet", tok)] == ["one", "two"]
    bad = datasets.Dataset.from_dict({"body": ["x"]})
    bad.to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(ConfigError, match=r"bad\.parquet row 0: row has no 'text' field \(its keys: body\)"):
        docs_of(tmp_path / "bad.parquet", tok)


# ---- chat ---------------------------------------------------------------------------------------
CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
}


def test_chat_trains_on_assistant_turns_only(tmp_path: Path, tok) -> None:  # type: ignore[no-untyped-def]
    (d,) = docs_of(write_jsonl(tmp_path / "c.jsonl", [CHAT]), tok)
    hf = tok.hf_tokenizer
    rendered = "<|system|>be brief<|end|><|user|>hi<|end|><|assistant|>hello<|end|><|user|>bye<|end|><|assistant|>ciao<|end|>"
    assert list(d.ids) == hf.encode(rendered, add_special_tokens=False) + [EOS]
    trained = [t for t, lab in zip(d.ids, d.labels, strict=True) if lab != IGNORE_INDEX]
    assert all(lab in (t, IGNORE_INDEX) for t, lab in zip(d.ids, d.labels, strict=True))
    # the replies, each with its end-of-turn marker, and the final EOS; no header, no prompt
    assert hf.decode(trained) == "hello<|end|>ciao<|end|></s>"


def test_chat_errors(tmp_path: Path, tok) -> None:  # type: ignore[no-untyped-def]
    bad_role = {"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}
    f = write_jsonl(tmp_path / "c.jsonl", [CHAT, bad_role])
    with pytest.raises(
        ConfigError, match=r"c\.jsonl:2: message 1 has unknown role 'robot'; roles are system, user"
    ):
        docs_of(f, tok)
    g = write_jsonl(tmp_path / "g.jsonl", [CHAT])
    with pytest.raises(
        ConfigError, match=r"g\.jsonl:1: a chat row .*tokenizer \(bytes\) has no chat template"
    ):
        load_documents(g, ByteTokenizer(300), vocab_size=300, eos_id=None)
    no_template = tokenizer_for(write_model(tmp_path / "m2", chat_template=False), 300)
    with pytest.raises(ConfigError, match=r"g\.jsonl:1: a chat row .*has no chat template"):
        docs_of(g, no_template)
    h = write_jsonl(tmp_path / "h.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(ConfigError, match=r"h\.jsonl:1: message 0 must be an object with string"):
        docs_of(h, tok)


# ---- bad input -----------------------------------------------------------------------------------
def test_bad_files_name_file_and_line(tmp_path: Path, tok) -> None:  # type: ignore[no-untyped-def]
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ConfigError, match=r"empty\.txt: the file is empty"):
        docs_of(empty, tok)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"ok\nstill ok\n\x00\x01\x02")
    with pytest.raises(ConfigError, match=r"bin\.txt:3: binary data"):
        docs_of(binary, tok)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"a\n\xe9t\xe9")
    with pytest.raises(ConfigError, match=r"latin\.txt:2: not UTF-8"):
        docs_of(latin, tok)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\n\n{"text": "b"\n')
    with pytest.raises(ConfigError, match=r"broken\.jsonl:3: malformed JSON"):
        docs_of(broken, tok)
    nofield = write_jsonl(tmp_path / "nofield.jsonl", [{"text": "a"}, {"body": "b"}])
    with pytest.raises(
        ConfigError, match=r"nofield\.jsonl:2: row has no 'text' field \(its keys: body\); pass --text-field"
    ):
        docs_of(nofield, tok)
    notobj = write_jsonl(tmp_path / "list.jsonl", [[1, 2]])
    with pytest.raises(ConfigError, match=r"list\.jsonl:1: a row must be a JSON object"):
        docs_of(notobj, tok)
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "x.csv").write_text("a")
    with pytest.raises(ConfigError, match=r"nothing: the folder has no usable files"):
        docs_of(tmp_path / "nothing", tok)
    with pytest.raises(ConfigError, match=r"gone: no such file or folder"):
        docs_of(tmp_path / "gone", tok)


# ---- packing, split, order ---------------------------------------------------------------------------
def test_pack_concatenates_then_splits_and_drops_the_tail(tmp_path: Path, tok) -> None:  # type: ignore[no-untyped-def]
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "abcde"}, {"text": "fgh"}, {"text": "ij"}])
    rows = pack(docs_of(f, tok), 4, "d")
    stream = [*b"abcde", EOS, *b"fgh", EOS, *b"ij", EOS]  # 13 tokens: 3 rows of 4, 1 dropped
    assert rows.input_ids.tolist() == [stream[0:4], stream[4:8], stream[8:12]]
    assert torch.equal(rows.labels, rows.input_ids)  # no masking at boundaries
    assert (rows.rows, rows.dropped, rows.documents, rows.tokens) == (3, 1, 3, 13)
    with pytest.raises(ConfigError, match=r"13 tokens in 3 documents, fewer than --seq-len 20"):
        pack(docs_of(f, tok), 20, "d")


def test_chat_labels_survive_packing(tmp_path: Path, tok) -> None:  # type: ignore[no-untyped-def]
    rows = pack(docs_of(write_jsonl(tmp_path / "c.jsonl", [CHAT] * 3), tok), 16, "c")
    assert 0.0 < rows.trained_label_fraction < 0.5
    kept = rows.labels != IGNORE_INDEX
    assert torch.equal(rows.labels[kept], rows.input_ids[kept])


def _rows(n: int, seq: int = 4):  # type: ignore[no-untyped-def]
    from tiered.finetune.data_sources import Document

    ids = tuple(range(n * seq))
    return pack([Document(ids, ids, "x")], seq, "x")


def test_split_eval_is_seeded_and_disjoint() -> None:
    rows = _rows(20)
    tr, ev = split_eval(rows, 0.25, seed=3)
    tr2, ev2 = split_eval(rows, 0.25, seed=3)
    _, ev3 = split_eval(rows, 0.25, seed=4)
    assert (tr.rows, ev.rows) == (15, 5) and torch.equal(ev.input_ids, ev2.input_ids)
    assert not torch.equal(ev.input_ids, ev3.input_ids)
    firsts = {r[0] for r in tr.input_ids.tolist()} | {r[0] for r in ev.input_ids.tolist()}
    assert len(firsts) == 20  # every row exactly once, in one of the two
    with pytest.raises(ConfigError, match=r"--eval-fraction must be between 0 and 1"):
        split_eval(rows, 1.5, 0)
    with pytest.raises(ConfigError, match=r"packs into 1 rows, too few"):
        split_eval(_rows(1), 0.5, 0)


def test_batches_cover_each_row_once_per_epoch_and_are_seeded() -> None:
    rows = _rows(10)
    a = PackedBatches(rows, 4, seed=1)
    seen = [r[0] // 4 for _ in range(5) for r in next(a)["input_ids"].tolist()]  # 20 rows = 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # a new permutation per epoch
    b = PackedBatches(rows, 4, seed=1)
    assert [r[0] // 4 for _ in range(5) for r in next(b)["input_ids"].tolist()] == seen
    c = PackedBatches(rows, 4, seed=2)
    assert [r[0] // 4 for r in next(c)["input_ids"].tolist()] != seen[:4]


def test_state_dict_resumes_exactly_and_is_json() -> None:
    rows = _rows(7)
    a = PackedBatches(rows, 3, seed=5)
    for _ in range(4):
        next(a)
    state = json.loads(json.dumps(a.state_dict()))
    assert state == {"epoch": 1, "offset": 5, "seed": 5, "rows": 7}
    want = [next(a)["input_ids"] for _ in range(3)]
    b = PackedBatches(rows, 3, seed=5)
    b.load_state_dict(state)
    for w in want:
        assert torch.equal(next(b)["input_ids"], w)
    with pytest.raises(ConfigError, match=r"made for seed 5 and 7 rows, but this run has seed 6"):
        PackedBatches(rows, 3, seed=6).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"missing keys \['offset'"):
        b.load_state_dict({"epoch": 0})
