"""The link tables: a database of the first version (no engine column) opens with its rows
kept and adopted by the saver's own engine; links pick each agent's last commit."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from langchain_agent_memory.graph.links import Links

V1 = """
CREATE TABLE history (agent_id TEXT NOT NULL, committed_at REAL NOT NULL, snapshot TEXT NOT NULL);
CREATE INDEX history_agent ON history (agent_id, committed_at);
CREATE TABLE links (thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL, checkpoint_id TEXT NOT NULL,
    agent_id TEXT NOT NULL, snapshot TEXT NOT NULL,
    PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id, agent_id));
CREATE TABLE snapshots (digest TEXT PRIMARY KEY);
INSERT INTO history VALUES ('t1:a', 5.0, 'd2');
INSERT INTO links VALUES ('t1', '', 'c1', 't1:a', 'd1');
INSERT INTO snapshots VALUES ('d1'), ('d2'), ('d3');
"""


def test_first_version_database_is_migrated_and_adopted(tmp_path: Path) -> None:
    path = tmp_path / "agent_links.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(V1)
    links = Links(path)
    assert links.linked("t1", "", "c1") == [("", "t1:a", "d1")]
    links.adopt("fp4")
    assert links.linked("t1", "", "c1") == [("fp4", "t1:a", "d1")]
    assert links.dead_snapshots() == [("fp4", "d3")]  # d1 linked, d2 in the history
    links.link("t1", "", "c2", at=6.0)
    assert links.linked("t1", "", "c2") == [("fp4", "t1:a", "d2")]
    links.close()
    reopened = Links(path)  # opening again migrates nothing twice
    assert reopened.linked("t1", "", "c1") == [("fp4", "t1:a", "d1")]


def test_links_choose_the_last_commit_before_the_checkpoint_per_engine(tmp_path: Path) -> None:
    links = Links(tmp_path / "links.sqlite")
    links.remember("e4", "t1:w", 1.0, "a")
    links.remember("e4", "t1:w", 3.0, "b")
    links.remember("e16", "t1:w", 2.0, "c")  # the same agent id on another engine
    links.remember("e4", "t2:w", 1.0, "z")  # another thread
    links.link("t1", "", "k", at=2.5)
    assert sorted(links.linked("t1", "", "k")) == [("e16", "t1:w", "c"), ("e4", "t1:w", "a")]
    assert links.engines_of_thread("t1") == {"e4", "e16"}
    links.copy_thread("t1", "t9")
    assert sorted(links.linked("t9", "", "k")) == [("e16", "t9:w", "c"), ("e4", "t9:w", "a")]
    links.drop_thread("t1")
    assert links.linked("t1", "", "k") == [] and links.linked_in_thread("t9")
