"""The data readers: the default calibration text (tests of engine/data/text.py that need no model)."""

from __future__ import annotations



def test_the_default_calibration_never_reads_the_held_out_c4_judge(tmp_path, monkeypatch):
    """The default data folder's c4/ less the documents the held-out C4 perplexity reads (they were calibration
    text of every default run before); a --calib that names the file, or another folder, reads what it names."""
    import gzip
    import json

    from engine.data.text import DATA_DIR_ENV, HELDOUT_C4_FILES, load_calibration_texts

    c4 = tmp_path / "c4"
    c4.mkdir()
    for name, text in (("train.json.gz", "a training document"), (HELDOUT_C4_FILES[0], "a judged document")):
        with gzip.open(c4 / name, "wt") as fh:
            fh.write(json.dumps({"text": text}) + "\n")
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert load_calibration_texts()[0] == ["a training document"]
    assert sorted(load_calibration_texts(str(c4))[0]) == ["a judged document", "a training document"]
    assert load_calibration_texts(str(c4 / HELDOUT_C4_FILES[0]))[0] == ["a judged document"]
