"""Bad data in a training run: skips by reason in metrics and the summary, and a data set with
nothing usable left stops the run after checkpointing the steps done."""

import orbax.checkpoint as ocp
import pytest
from test_multimodal_training import multimodal_run
from tiny import tiny_run

import pretrain.data_loading
from data.mm_documents import DataError
from data.shard_builder import write_documents
from data.shard_inputs import InputDocument
from data.text_loader import PackedTextLoader
from pretrain.metrics import read_metrics
from pretrain.train import train


def test_skipped_documents_are_in_metrics_and_summary_by_reason(tmp_path, capsys):
    documents = [
        InputDocument(f"t{i}", f"t{i}", "tests", "CC0", {}, (("text", f"text doc {i}"),))
        for i in range(12)
    ]
    write_documents(documents, tmp_path / "set", shard_size=200)  # 4 documents a shard
    shard = sorted((tmp_path / "set").glob("shard-*.array_record"))[1]
    shard.write_bytes(shard.read_bytes()[:100])  # its records are unreadable, the others fine
    run = multimodal_run(
        data={"shards": [str(tmp_path / "set")], "weights": []}, train={"steps": 4}
    )  # the demo runs' shapes: their compilation is cached
    summary = train(run, tmp_path / "run")
    skipped = summary["skipped_documents"]
    assert skipped["skipped_documents"] == skipped["skipped_unreadable"] > 0
    assert skipped["documents_read"] > 0 and skipped["skipped_bad_media"] == 0
    last = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert last["skipped_unreadable"] == skipped["skipped_unreadable"]
    out = capsys.readouterr().out
    assert (
        "were unusable (" in out and f"skipped: unreadable {skipped['skipped_unreadable']}" in out
    )


class _RunsDryLoader(PackedTextLoader):
    """Two good batches, then nothing usable (as the multimodal loader reports it)."""

    def __next__(self):
        if self._rows_emitted >= 2 * self.batch_size:
            self._rows_emitted += 1  # mid-batch: not the position to save
            raise DataError("12 unusable documents in a row, ...; the latest: set/shard#3: bad")
        return super().__next__()


def test_running_out_of_usable_data_checkpoints_the_steps_done(tmp_path, monkeypatch):
    monkeypatch.setattr(pretrain.data_loading, "PackedTextLoader", _RunsDryLoader)
    with pytest.raises(DataError, match=r"set/shard#3: bad; stopped: checkpoint at step 2 saved"):
        train(tiny_run(), tmp_path / "run")
    saved = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
        tmp_path / "run" / "checkpoints" / "2" / "data"
    )
    assert saved["process_count"] == 1  # one process's position (pretrain/distributed.py)
    assert (
        saved["processes"][0]["rows_emitted"] == 2 * 4
    )  # where step 3 starts: a fixed data set resumes there
