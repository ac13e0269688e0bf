"""Small synthetic shard sets shared by the data tests (built once per session, in seconds)."""

import pytest
from media_fixtures import TINY, multimodal_documents

from data.shard_builder import InputDocument, write_documents


@pytest.fixture(scope="session")
def mm_shards(tmp_path_factory):
    """24 interleaved documents in several shards."""
    path = tmp_path_factory.mktemp("shards") / "mm"
    write_documents(multimodal_documents(24), path, shard_size=60_000, processor=TINY)
    return path


@pytest.fixture(scope="session")
def text_shards(tmp_path_factory):
    path = tmp_path_factory.mktemp("shards") / "text"
    documents = [
        InputDocument(
            f"t{i}", f"t{i}", "tests", "CC0-1.0", {}, (("text", f"text doc {i} " * (i + 1)),)
        )
        for i in range(30)
    ]
    write_documents(documents, path, shard_size=1_000, processor=TINY)
    return path
