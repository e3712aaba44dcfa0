"""Tests for qmem.py: python3 -m unittest -v test_qmem

Standard library only, offline, loopback only. Every test runs with a fresh
temporary HOME (and QMEM_* variables pointing into it), so nothing touches the
real one. Classes follow the layers of qmem.py.
"""
import contextlib
import io
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import qmem

HERE = os.path.dirname(os.path.abspath(__file__))
QMEM = os.path.join(HERE, "qmem.py")
UUIDS = ["%08x-0000-4000-8000-%012x" % (n, n) for n in range(1, 200)]


class QmemTestCase(unittest.TestCase):
    """A fresh HOME per test, and a harness that runs the CLI in-process."""

    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.home = tmp.name
        env = {k: v for k, v in os.environ.items() if not k.startswith(("QMEM_", "PI_CODING_AGENT"))}
        env.update(HOME=self.home, NO_PROXY="*", no_proxy="*")
        patcher = mock.patch.dict(os.environ, env, clear=True)
        patcher.start()
        self.addCleanup(patcher.stop)
        self.db = os.path.join(self.home, ".local", "share", "pi-qmem", "qmem.sqlite")
        self.sessions = os.path.join(self.home, ".pi", "agent", "sessions")

    def run_cli(self, *argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = qmem.main(list(argv))
            except SystemExit as e:  # argparse
                code = e.code
        return code, out.getvalue(), err.getvalue()

    def ok(self, *argv):
        code, out, err = self.run_cli(*argv)
        self.assertEqual(code, 0, "exit %s, stderr: %s" % (code, err))
        return out

    def ok_json(self, *argv):
        return json.loads(self.ok(*(argv + ("--json",))))

    def expect_fail(self, expected_code, *argv):
        code, out, err = self.run_cli(*argv)
        self.assertEqual(code, expected_code, "stdout: %s stderr: %s" % (out, err))
        self.assertNotIn("Traceback", err)
        self.assertTrue(err.startswith("qmem: "), err)
        return err

    def find_ids(self, *argv):
        return [r["id"] for r in self.ok_json("find", *argv)["results"]]


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


# --- Session files in pi's formats (pi-sessions.md) ---------------------------

def record(rid, text, kind="fact", project="infra", **extra):
    rec = {"id": rid, "text": text, "kind": kind, "project_id": project, "scope": "project",
           "agent_id": "pi", "source": "pi-coding-agent", "private": False,
           "created_at": "2026-11-30T09:17:18.955Z", "updated_at": "2026-11-30T09:17:18.955Z",
           "expires_at": None, "supersedes_id": None, "supersede_reason": None,
           "superseded_by": None, "deleted_at": None}
    rec.update(extra)
    return rec


class Session:
    """Writes one session file the way pi does: a header line, then one entry per line.
    version 1 has no ids; versions 2 and 3 chain entries by parentId."""

    def __init__(self, folder, name, version=3, cwd="/home/dev/projects/infra", parent=None):
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, name)
        self.version, self.n, self.leaf = version, 0, None
        header = {"type": "session", "id": "01a22bbe-98fd-7683-906a-%012d" % len(name),
                  "timestamp": "2026-11-30T09:17:21.022Z", "cwd": cwd}
        if version > 1:
            header["version"] = version
        if parent:
            header["parentSession"] = parent
        self.lines = [header]
        self.entry({"role": "user", "content": [{"type": "text", "text": "Ciao"}]})

    def entry(self, message, parent="leaf"):
        self.n += 1
        line = {"type": "message", "timestamp": "2026-11-30T09:%02d:%02d.000Z" % (20 + self.n // 60, self.n % 60),
                "message": message}
        if self.version > 1:
            line["id"] = "%08x" % (0xabc00000 + self.n)
            line["parentId"] = self.leaf if parent == "leaf" else parent
            self.leaf = line["id"]
        self.lines.append(line)
        return line.get("id")

    def call(self, name, args, call_id=None):
        call_id = call_id or "toolu_%s_%d" % (name, self.n)
        self.entry({"role": "assistant", "stopReason": "toolUse", "content": [
            {"type": "thinking", "thinking": "Salvo una memoria."},
            {"type": "toolCall", "id": call_id, "name": name, "arguments": args}]})
        return call_id

    def result(self, call_id, name, text, details=None, is_error=False):
        msg = {"role": "toolResult", "toolCallId": call_id, "toolName": name,
               "content": [{"type": "text", "text": text}], "isError": is_error}
        if details is not None:
            msg["details"] = details
        self.entry(msg)

    def store(self, rec, shape="record"):
        """A qmem_store call and its result, in one of the extension's result shapes."""
        args = {k: rec[k] for k in ("text", "kind", "project_id")}
        cid = self.call("qmem_store", args)
        if shape == "record":
            self.result(cid, "qmem_store", "Stored memory %s" % rec["id"], {"id": rec["id"], "record": rec})
        elif shape == "id":
            self.result(cid, "qmem_store", "Stored memory %s" % rec["id"], {"id": rec["id"]})
        elif shape == "json":
            self.result(cid, "qmem_store", json.dumps({"id": rec["id"], "status": "stored"}))
        else:
            self.result(cid, "qmem_store", "✅ Memoria salvata: %s" % rec["id"])
        return cid

    def write(self, truncate_last=False):
        data = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in self.lines)
        if truncate_last:
            data = data[:-20]
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(data)
        return self.path


class ConfigTests(QmemTestCase):

    def test_missing_config_file_gives_defaults(self):
        cfg = qmem.load_config()
        self.assertEqual(cfg["connectTimeoutMs"], 15000)
        self.assertEqual(cfg.sources["url"], "default")
        self.assertEqual(cfg.db_path, self.db)

    def test_precedence_defaults_file_env_flags(self):
        path = os.path.join(self.home, ".config", "pi-qmem", "config.json")
        os.makedirs(os.path.dirname(path))
        with open(path, "w") as f:
            json.dump({"url": "https://file.example", "timeoutMs": 1234, "unknownKey": 1,
                       "localDbPath": "/from/file.sqlite"}, f)
        with mock.patch.dict(os.environ, {"QMEM_URL": "https://env.example", "QMEM_SQLITE": "/from/env.sqlite"}):
            cfg = qmem.load_config(overrides={"localDbPath": "/from/flag.sqlite"})
        self.assertEqual(cfg["url"], "https://env.example")
        self.assertEqual(cfg.sources["url"], "env QMEM_URL")
        self.assertEqual(cfg["timeoutMs"], 1234)
        self.assertEqual(cfg.sources["timeoutMs"], "file")
        self.assertEqual(cfg.db_path, "/from/flag.sqlite")

    def test_invalid_config_is_a_usage_error_naming_the_file(self):
        path = os.path.join(self.home, "bad.json")
        with open(path, "w") as f:
            f.write("{not json")
        os.environ["QMEM_CONFIG"] = path
        err = self.expect_fail(2, "status")
        self.assertIn(path, err)
        self.assertIn("not valid JSON", err)

    def test_wrong_type_in_config_is_named(self):
        path = os.path.join(self.home, "bad.json")
        with open(path, "w") as f:
            json.dump({"timeoutMs": "soon"}, f)
        os.environ["QMEM_CONFIG"] = path
        self.assertIn("timeoutMs", self.expect_fail(2, "status"))

    def test_secret_is_masked(self):
        self.assertEqual(qmem.mask_secret("sk-live-0123456789abcd"), "sk-…abcd")
        self.assertNotIn("0123", qmem.mask_secret("sk-live-0123456789abcd"))

    def test_session_dirs_follow_pi(self):
        self.assertEqual(qmem.session_dirs(), [self.sessions])
        os.environ["PI_CODING_AGENT_DIR"] = "/agent"
        self.assertEqual(qmem.session_dirs(), ["/agent/sessions"])
        os.environ["PI_CODING_AGENT_SESSION_DIR"] = "/custom"
        self.assertEqual(qmem.session_dirs(), ["/custom"])


class StoreTests(QmemTestCase):

    def test_created_with_parents_wal_and_schema_version(self):
        store = qmem.Store(self.db)
        self.addCleanup(store.close)
        self.assertTrue(os.path.isfile(self.db))
        self.assertEqual(store.conn.execute("PRAGMA journal_mode").fetchone()[0], "wal")
        self.assertEqual(store.conn.execute("PRAGMA user_version").fetchone()[0], qmem.SCHEMA_VERSION)

    def test_newer_schema_is_refused_and_left_untouched(self):
        os.makedirs(os.path.dirname(self.db))
        conn = sqlite3.connect(self.db)
        conn.execute("PRAGMA user_version=99")
        conn.close()
        before = read_bytes(self.db)
        err = self.expect_fail(1, "find", "x")
        self.assertIn("newer qmem.py", err)
        self.assertEqual(read_bytes(self.db), before)

    def test_a_file_that_is_not_sqlite_is_refused_and_left_untouched(self):
        os.makedirs(os.path.dirname(self.db))
        with open(self.db, "wb") as f:
            f.write(b"these are my notes, not a database\n" * 10)
        before = read_bytes(self.db)
        err = self.expect_fail(1, "status")
        self.assertIn("not a SQLite database", err)
        self.assertEqual(read_bytes(self.db), before)

    def test_merge_never_replaces_known_data_with_missing_data(self):
        store = qmem.Store(self.db)
        self.addCleanup(store.close)
        full = qmem.normalize_record(record(UUIDS[0], "Il backup notturno gira alle 02:30"))
        with store.transaction():
            store.upsert(full, qmem.VIEW_FULL)
            hit = qmem.normalize_record({"id": UUIDS[0], "text": "Il backup", "kind": None})
            self.assertEqual(store.upsert(hit, qmem.VIEW_HIT), "same")
        got = store.get(UUIDS[0])
        self.assertEqual(got["text"], "Il backup notturno gira alle 02:30")
        self.assertEqual(got["kind"], "fact")

    def test_complete_view_wins_over_search_hit(self):
        store = qmem.Store(self.db)
        self.addCleanup(store.close)
        with store.transaction():
            store.upsert(qmem.normalize_record({"id": UUIDS[0], "text": "troncato…", "kind": "fact"}),
                         qmem.VIEW_HIT)
            self.assertEqual(store.upsert(qmem.normalize_record(record(UUIDS[0], "testo completo")),
                                          qmem.VIEW_FULL), "updated")
        self.assertEqual(store.get(UUIDS[0])["text"], "testo completo")
        self.assertEqual(qmem.find_local(store, "completo")["results"][0]["id"], UUIDS[0])
        self.assertEqual(qmem.find_local(store, "troncato")["results"], [])

    def test_mutable_fields_follow_the_newest_updated_at(self):
        store = qmem.Store(self.db)
        self.addCleanup(store.close)
        with store.transaction():
            store.upsert(qmem.normalize_record(record(UUIDS[0], "x", updated_at="2026-11-30T10:00:00Z",
                                                      deleted_at="2026-11-30T10:00:00Z")), qmem.VIEW_FULL)
            # an older view cannot undo the deletion
            store.upsert(qmem.normalize_record(record(UUIDS[0], "x", updated_at="2026-11-29T10:00:00Z")),
                         qmem.VIEW_FULL)
        self.assertEqual(store.get(UUIDS[0])["deleted_at"], "2026-11-30T10:00:00.000Z")

    def test_interrupted_bulk_load_still_finds_everything_and_is_repaired(self):
        store = qmem.Store(self.db)
        self.addCleanup(store.close)
        store.begin_bulk()  # an import into an empty index defers FTS to its end...
        with store.transaction():
            store.upsert(qmem.normalize_record(record(UUIDS[0], "bulk loaded memory")), qmem.VIEW_FULL)
        # ...and dies before finish_bulk(): find answers through the LIKE scan meanwhile
        self.assertEqual(self.find_ids("bulk", "memory"), [UUIDS[0]])
        os.makedirs(self.sessions)
        self.ok("import")  # the next import rebuilds the index
        self.assertIsNone(store.meta("fts_pending"))
        self.assertEqual(store.conn.execute(
            "SELECT rowid FROM records_fts WHERE records_fts MATCH 'bulk'").fetchall(), [(1,)])

    def test_two_processes_write_at_once(self):
        qmem.Store(self.db).close()
        code = ("import qmem, sys\ns = qmem.Store(sys.argv[1])\nfor i in range(200):\n"
                "    with s.transaction():\n"
                "        s.upsert(qmem.normalize_record({'id': sys.argv[2] + str(i), 'text': 'parallel write'}), 2)\n")
        procs = [subprocess.Popen([sys.executable, "-c", code, self.db, tag], cwd=HERE) for tag in "ab"]
        self.assertEqual([p.wait(timeout=60) for p in procs], [0, 0])
        store = qmem.Store(self.db)
        self.addCleanup(store.close)
        self.assertEqual(store.conn.execute("SELECT count(*) FROM records").fetchone()[0], 400)


class ImportTests(QmemTestCase):

    def import_json(self, *extra):
        return self.ok_json("import", *extra)["stats"]

    def test_store_results_in_every_shape_become_records(self):
        s = Session(os.path.join(self.sessions, "--home-dev-projects-infra--"), "a.jsonl")
        for n, shape in enumerate(("record", "id", "json", "text")):
            s.store(record(UUIDS[n], "Memoria numero %d sul deploy" % n), shape=shape)
        s.write()
        stats = self.import_json()
        self.assertEqual(stats["records_new"], 4)
        self.assertEqual(stats["calls"], {"qmem_store": 4})
        results = self.ok_json("find", "deploy")["results"]
        self.assertEqual(sorted(r["id"] for r in results), sorted(UUIDS[:4]))
        for r in results:  # fields the result did not carry come from the call's arguments
            self.assertEqual((r["kind"], r["project_id"]), ("fact", "infra"))

    def test_formats_v1_v2_v3_are_all_read(self):
        for version in (1, 2, 3):
            s = Session(self.sessions, "v%d.jsonl" % version, version=version)
            s.store(record(UUIDS[version], "formato versione %d" % version))
            s.write()
        self.import_json()
        self.assertEqual(sorted(self.find_ids("formato")), sorted(UUIDS[1:4]))

    def test_every_branch_is_imported(self):
        s = Session(self.sessions, "tree.jsonl")
        fork_point = s.leaf
        s.store(record(UUIDS[0], "abandoned branch still stored this"))
        s.entry({"role": "user", "content": [{"type": "text", "text": "back to the fork"}]}, parent=fork_point)
        s.store(record(UUIDS[1], "active branch stored this"))
        s.write()
        self.import_json()
        self.assertEqual(sorted(self.find_ids("branch", "stored")), sorted(UUIDS[:2]))

    def test_clone_is_deduplicated_by_record_id(self):
        s = Session(self.sessions, "orig.jsonl")
        s.store(record(UUIDS[0], "cloned memory"))
        s.write()
        clone = Session(self.sessions, "clone.jsonl", parent=s.path)
        clone.lines[1:] = s.lines[1:]  # a clone copies entries, ids and toolCall ids included
        clone.write()
        stats = self.import_json()
        self.assertEqual(stats["records_new"], 1)
        self.assertEqual(self.ok_json("status")["records"]["total"], 1)

    def test_errored_call_and_call_without_result_create_nothing(self):
        s = Session(self.sessions, "errors.jsonl")
        cid = s.call("qmem_store", {"text": "never stored", "kind": "fact", "project_id": "infra"})
        s.result(cid, "qmem_store", "qmem gateway unreachable: connect ECONNREFUSED", {}, is_error=True)
        cid = s.call("qmem_get", {"id": UUIDS[5]})
        s.result(cid, "qmem_get", "qmem gateway unreachable", {}, is_error=True)
        s.call("qmem_store", {"text": "stream errored before running", "kind": "fact", "project_id": "infra"})
        s.write()
        stats = self.import_json()
        self.assertEqual(stats["records_new"], 0)
        self.assertEqual(stats["calls_errored"], 2)
        self.assertEqual(stats["calls_without_result"], 1)
        self.assertEqual(self.find_ids("stored"), [])

    def test_soft_error_with_record_in_details_creates_the_record(self):
        s = Session(self.sessions, "soft.jsonl")
        rec = record(UUIDS[0], "Decision: in Q3 the staging DB moves onto the città-app cluster")
        cid = s.call("qmem_store", {"text": rec["text"], "kind": "decision", "project_id": "infra"})
        s.result(cid, "qmem_store", "Stored memory %s locally (fallback: local_sqlite)" % UUIDS[0],
                 {"id": UUIDS[0], "record": rec, "fallback": "local_sqlite", "synced": False}, is_error=True)
        s.write()
        self.import_json()
        self.assertEqual(self.find_ids("staging", "citta"), [UUIDS[0]])

    def test_search_hits_from_other_agents_are_partial_views(self):
        s = Session(self.sessions, "search.jsonl")
        hit = record(UUIDS[7], "Ollama serve gli embedding sul nodo gpu-2", agent_id="claude@ci", score=0.71)
        cid = s.call("qmem_search", {"query": "embedding", "top_k": 8})
        s.result(cid, "qmem_search", "1. [0.71] ...", {"results": [hit]})
        s.write()
        self.import_json()
        found = self.ok_json("find", "embedding")["results"]
        self.assertEqual([(r["id"], r["agent_id"]) for r in found], [(UUIDS[7], "claude@ci")])
        status = self.ok_json("status")
        self.assertEqual(status["records"]["partial_only"], 1)
        self.assertEqual(status["coverage"]["search_hit_only"], 1)

    def test_get_gives_the_full_payload(self):
        s = Session(self.sessions, "get.jsonl")
        cid = s.call("qmem_get", {"id": UUIDS[3]})
        s.result(cid, "qmem_get", json.dumps(record(UUIDS[3], "Payload completo da get")))
        s.write()
        self.import_json()
        self.assertEqual(self.find_ids("payload"), [UUIDS[3]])
        self.assertEqual(self.ok_json("status")["records"]["partial_only"], 0)

    def test_correction_supersedes_the_old_record_in_any_order(self):
        s = Session(self.sessions, "a-correct.jsonl")  # read before the file with the original
        new = record(UUIDS[1], "Il backup notturno parte alle 02:30", supersedes_id=UUIDS[0])
        cid = s.call("qmem_correct", {"id": UUIDS[0], "text": new["text"], "reason": "orario cambiato"})
        s.result(cid, "qmem_correct", "Corrected: new memory %s supersedes %s" % (UUIDS[1], UUIDS[0]),
                 {"id": UUIDS[1], "superseded_id": UUIDS[0]})
        s.write()
        s = Session(self.sessions, "b-store.jsonl")
        s.store(record(UUIDS[0], "Il backup notturno parte alle 03:00"))
        s.write()
        self.import_json()
        self.assertEqual(self.find_ids("backup", "notturno"), [UUIDS[1]])
        old = [r for r in self.ok_json("find", "backup", "--include-superseded")["results"] if r["id"] == UUIDS[0]]
        self.assertEqual(old[0]["superseded_by"], UUIDS[1])
        # the correction, given only text and reason, inherits the target's project and kind
        self.assertEqual(self.find_ids("02:30", "--project", "infra", "--kind", "fact"), [UUIDS[1]])

    def test_accented_italian_text(self):
        s = Session(self.sessions, "it.jsonl", cwd="/home/dev/projects/città-app")
        s.store(record(UUIDS[0], "Perché la città usa il caffè delle 02:30? Però sì."))
        s.write()
        self.import_json()
        for query in ("perche", "perché", "citta", "città", "caffe", "PERCHÉ CITTÀ"):
            self.assertEqual(self.find_ids(query), [UUIDS[0]], query)

    def test_truncated_last_line_is_read_once_complete(self):
        s = Session(self.sessions, "live.jsonl")
        s.store(record(UUIDS[0], "prima memoria"))
        s.store(record(UUIDS[1], "seconda memoria"))
        s.write(truncate_last=True)
        stats = self.import_json()
        self.assertEqual(stats["lines_truncated"], 1)
        self.assertEqual(self.find_ids("memoria"), [UUIDS[0]])
        s.write()  # the writer finished the line
        stats = self.import_json()
        self.assertEqual(stats["records_new"], 1)
        self.assertEqual(sorted(self.find_ids("memoria")), sorted(UUIDS[:2]))

    def test_second_import_of_unchanged_tree_reads_nothing(self):
        s = Session(self.sessions, "one.jsonl")
        s.store(record(UUIDS[0], "una memoria"))
        s.write()
        self.import_json()
        store = qmem.Store(self.db)
        self.addCleanup(store.close)
        with mock.patch("builtins.open", side_effect=AssertionError("a session file was read")):
            stats = qmem.Importer(store).run([self.sessions])
        self.assertEqual((stats.files_unchanged, stats.files_read, stats.bytes_read), (1, 0, 0))

    def test_grown_file_is_read_from_the_last_complete_line(self):
        s = Session(self.sessions, "grow.jsonl")
        s.store(record(UUIDS[0], "scritta prima"))
        cid = s.call("qmem_store", {"text": "scritta dopo", "kind": "fact", "project_id": "infra"})
        size_before = os.path.getsize(s.write())
        stats = self.import_json()
        self.assertEqual(stats["calls_without_result"], 1)
        s.result(cid, "qmem_store", "Stored memory %s" % UUIDS[1], {"id": UUIDS[1]})
        size_after = os.path.getsize(s.write())
        stats = self.import_json()
        self.assertEqual(stats["bytes_read"], size_after - size_before)
        self.assertEqual(stats["records_new"], 1)  # the call from the first read got its result
        self.assertEqual(self.find_ids("dopo"), [UUIDS[1]])

    def test_invalid_lines_are_counted_and_skipped(self):
        s = Session(self.sessions, "bad.jsonl")
        s.store(record(UUIDS[0], "valida"))
        path = s.write()
        with open(path, "a") as f:
            f.write('{"type":"message","message":{"role":"toolResult","toolName":"qmem_store" BROKEN\n')
        self.assertEqual(self.import_json()["lines_skipped"], 1)
        self.assertEqual(self.find_ids("valida"), [UUIDS[0]])

    def test_a_file_that_is_not_a_session_is_skipped_with_a_warning(self):
        os.makedirs(self.sessions)
        with open(os.path.join(self.sessions, "notes.jsonl"), "w") as f:
            f.write("this is not json\n")
        code, out, err = self.run_cli("import")
        self.assertEqual(code, 0)
        self.assertIn("not a pi session file", err)
        self.assertNotIn("Traceback", err)

    def test_summary_counts_files_calls_and_records(self):
        s = Session(self.sessions, "sum.jsonl")
        s.store(record(UUIDS[0], "riassunto"))
        s.write()
        out = self.ok("import")
        self.assertIn("1 files scanned", out)
        self.assertIn("qmem_store 1", out)
        self.assertIn("1 new", out)

    def test_sessions_option_is_repeatable(self):
        for n in range(2):
            s = Session(os.path.join(self.home, "dir%d" % n), "s.jsonl")
            s.store(record(UUIDS[n], "cartella personalizzata"))
            s.write()
        self.import_json("--sessions", os.path.join(self.home, "dir0"), "--sessions", os.path.join(self.home, "dir1"))
        self.assertEqual(len(self.find_ids("cartella")), 2)

    def test_missing_sessions_dir_is_a_usage_error(self):
        err = self.expect_fail(2, "import", "--sessions", os.path.join(self.home, "nope"))
        self.assertIn("no such directory", err)

    def test_fresh_machine_without_sessions_says_where_it_looked(self):
        out = self.ok("import")
        self.assertIn(self.sessions, out)
        self.assertIn("nothing to import", out)


class FindTests(QmemTestCase):

    def setUp(self):
        super().setUp()
        self.store = qmem.Store(self.db)
        self.addCleanup(self.store.close)

    def put(self, n, text, view=qmem.VIEW_FULL, **extra):
        with self.store.transaction():
            self.store.upsert(qmem.normalize_record(record(UUIDS[n], text, **extra)), view)

    def test_all_words_must_match_and_last_is_a_prefix(self):
        self.put(0, "The circuit breaker opens after three failures")
        self.put(1, "A circuit of the city")
        out = self.ok_json("find", "circuit", "break")
        self.assertEqual(out["match"], "all")
        self.assertEqual([r["id"] for r in out["results"]], [UUIDS[0]])
        self.assertEqual(sorted(self.find_ids("circ")), sorted(UUIDS[:2]))

    def test_no_full_match_falls_back_to_any_word_and_says_so(self):
        self.put(0, "deploy on node-3")
        out = self.ok_json("find", "deploy", "kubernetes")
        self.assertEqual(out["match"], "any")
        self.assertEqual(out["results"][0]["id"], UUIDS[0])
        self.assertIn("partial match (any word)", self.ok("find", "deploy", "kubernetes"))

    def test_bm25_ranks_the_better_match_first(self):
        self.put(0, "qdrant mentioned once among many other words about the weather and lunch")
        self.put(1, "qdrant qdrant: the qdrant collection")
        self.assertEqual(self.find_ids("qdrant"), [UUIDS[1], UUIDS[0]])

    def test_hostile_queries_are_plain_words(self):
        self.put(0, "deploy on node-3 uses blue/green; it's C++ -O2 kind:fact")
        for q in ('"', "deploy\"", "(", "NEAR(", "text:", "*", "-O2", "AND", "OR", "NOT deploy",
                  "kind:fact", "C++", "blue/green", "it's", "node-3", "🚀", "') OR 1=1 --", "^deploy", "{x}"):
            code, out, err = self.run_cli("find", "--json", "--", q)
            self.assertEqual(code, 0, (q, err))
            json.loads(out)
        # kind:fact is two words, not a column filter: it matches the text itself
        self.assertEqual(self.find_ids("kind:fact"), [UUIDS[0]])
        self.assertEqual(self.find_ids("node-3"), [UUIDS[0]])

    def test_empty_query_is_a_usage_error(self):
        self.expect_fail(2, "find", "")
        self.expect_fail(2, "find")

    def test_hidden_records_and_the_flags_that_show_them(self):
        self.put(0, "visible alpha")
        self.put(1, "superseded alpha", superseded_by=UUIDS[0])
        self.put(2, "deleted alpha", deleted_at="2026-11-30T10:00:00Z")
        self.put(3, "private alpha", private=True)
        self.put(4, "expired alpha", expires_at="2020-01-01T00:00:00Z")
        self.assertEqual(self.find_ids("alpha"), [UUIDS[0]])
        self.assertIn(UUIDS[1], self.find_ids("alpha", "--include-superseded"))
        self.assertEqual(self.find_ids("alpha", "--deleted"), [UUIDS[2]])
        self.assertIn(UUIDS[3], self.find_ids("alpha", "--private"))
        self.assertIn(UUIDS[4], self.find_ids("alpha", "--include-expired"))

    def test_filters_and_limit(self):
        self.put(0, "gamma one", project="infra", kind="fact", scope="project")
        self.put(1, "gamma two", project="web", kind="decision", scope="global")
        self.assertEqual(self.find_ids("gamma", "--project", "web"), [UUIDS[1]])
        self.assertEqual(self.find_ids("gamma", "--kind", "fact"), [UUIDS[0]])
        self.assertEqual(self.find_ids("gamma", "--scope", "global"), [UUIDS[1]])
        self.assertEqual(len(self.find_ids("gamma", "--limit", "1")), 1)
        self.expect_fail(2, "find", "gamma", "--kind", "rumour")

    def test_json_shape(self):
        self.put(0, "delta record", agent_id="pi@laptop")
        out = self.ok_json("find", "delta")
        self.assertEqual((out["source"], out["match"], out["degraded"]), ("local_sqlite", "all", False))
        self.assertEqual(set(out["results"][0]), {
            "id", "text", "kind", "project_id", "scope", "agent_id", "created_at", "superseded_by",
            "deleted_at", "private", "pending", "rank"})
        self.assertEqual(out["results"][0]["rank"], 1)

    def test_human_output_header_and_pending_marker(self):
        self.put(0, "epsilon queued here")
        self.store.conn.execute("UPDATE records SET pending=1")
        out = self.ok("find", "epsilon")
        self.assertIn("local_sqlite · lexical (not semantic)", out.splitlines()[0])
        line = out.splitlines()[1]
        self.assertTrue(line.startswith(UUIDS[0]))
        self.assertIn("PENDING", line)
        self.assertNotIn("\x1b", out)  # plain text when stdout is not a terminal

    def test_find_without_any_index_yet(self):
        os.environ["QMEM_SQLITE"] = os.path.join(self.home, "none.sqlite")
        code, out, err = self.run_cli("find", "x")
        self.assertEqual(code, 0)
        self.assertIn("no local index yet", err)
        self.assertFalse(os.path.exists(os.path.join(self.home, "none.sqlite")))


class NoFts5Tests(QmemTestCase):
    """The LIKE path of a SQLite built without FTS5, forced."""

    def setUp(self):
        super().setUp()
        patcher = mock.patch.object(qmem, "FORCE_NO_FTS5", True)
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_like_search_with_accents_and_a_one_time_notice(self):
        s = Session(self.sessions, "it.jsonl")
        s.store(record(UUIDS[0], "Perché la città usa 100% del disco_dati"))
        s.write()
        code, out, err = self.run_cli("import")
        self.assertEqual(code, 0)
        self.assertIn("no FTS5", err)
        self.assertEqual(self.find_ids("perche", "citta"), [UUIDS[0]])
        self.assertEqual(self.find_ids("città"), [UUIDS[0]])
        self.assertEqual(self.find_ids("100%"), [UUIDS[0]])
        self.assertEqual(self.find_ids("50%"), [])
        out = self.ok_json("find", "perche", "nothing")
        self.assertEqual(out["match"], "any")
        code, out, err = self.run_cli("find", "perche")
        self.assertEqual(err, "")  # said once, at creation, not on every search
        self.assertIn("LIKE", self.ok("status"))


class StatusTests(QmemTestCase):

    def test_counts_and_json_keys(self):
        s = Session(self.sessions, "st.jsonl")
        s.store(record(UUIDS[0], "uno", kind="fact", project="infra"))
        s.store(record(UUIDS[1], "due", kind="decision", project="web", private=True))
        s.store(record(UUIDS[2], "uno", kind="fact", project="web"))  # same text, other id
        s.write()
        self.ok("import")
        st = self.ok_json("status")
        self.assertEqual(st["records"]["total"], 3)
        self.assertEqual(st["records"]["by_kind"], {"fact": 2, "decision": 1})
        self.assertEqual(st["records"]["by_project"], {"web": 2, "infra": 1})
        self.assertEqual(st["records"]["private"], 1)
        self.assertEqual(st["outbox"]["pending"], 0)
        self.assertEqual(st["duplicates"], {"groups": 1, "records": 2})
        self.assertEqual(st["db"]["schema_version"], qmem.SCHEMA_VERSION)
        self.assertTrue(st["fts"]["available"])
        self.assertTrue(st["lag"]["last_import_at"])
        self.assertEqual(st["lag"]["newest_entry_imported_at"][:10], "2026-11-30")
        self.assertIn("(", st["machine"])
        text = self.ok("status")
        self.assertIn("records: 3", text)

    def test_status_before_anything_was_imported(self):
        err = self.expect_fail(1, "status")
        self.assertIn("no local index yet", err)


class CliTests(QmemTestCase):

    def test_usage_errors_exit_2_without_traceback(self):
        self.expect_fail(2, "frobnicate")
        self.expect_fail(2, "find", "--limit")
        self.expect_fail(2, "find", "x", "--limit", "zero")

    def test_json_flag_before_or_after_the_subcommand(self):
        os.makedirs(self.sessions)
        self.assertIn("stats", json.loads(self.ok("--json", "import")))
        self.assertIn("stats", json.loads(self.ok("import", "--json")))

    def test_interrupt_exits_130(self):
        with mock.patch.object(qmem, "cmd_status", side_effect=KeyboardInterrupt):
            parser = qmem.build_parser
            with mock.patch.object(qmem, "build_parser", side_effect=lambda: _rebind(parser())):
                code, out, err = self.run_cli("status")
        self.assertEqual(code, 130)

    def test_runs_as_a_script_and_find_loads_no_network_module(self):
        env = dict(os.environ)
        probe = ("import runpy, sys; sys.argv = ['qmem.py', 'find', 'x'];\n"
                 "try:\n    runpy.run_path(%r, run_name='__main__')\nexcept SystemExit:\n    pass\n"
                 "bad = [m for m in ('ssl', 'http.client', 'socket', 'urllib.request') if m in sys.modules]\n"
                 "sys.stderr.write('NET:%%s' %% bad)\n" % QMEM)
        p = subprocess.run([sys.executable, "-c", probe], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, universal_newlines=True)
        self.assertIn("NET:[]", p.stderr)
        p = subprocess.run([sys.executable, QMEM, "--help"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, universal_newlines=True)
        self.assertEqual(p.returncode, 0)
        for name in ("import", "find", "status"):
            self.assertIn(name, p.stdout)


class CompatibilityTests(unittest.TestCase):

    @unittest.skipUnless(sys.version_info >= (3, 8), "ast feature_version needs Python 3.8+")
    def test_source_parses_as_python_3_6(self):
        import ast
        for path in (QMEM, os.path.join(HERE, "test_qmem.py")):
            with open(path, encoding="utf-8") as f:
                ast.parse(f.read(), path, feature_version=(3, 6))  # novermin (guarded above)


def _rebind(parser):
    """Point the status subcommand at the (patched) qmem.cmd_status."""
    parser._subparsers._group_actions[0].choices["status"].set_defaults(func=lambda ctx: qmem.cmd_status(ctx))
    return parser


if __name__ == "__main__":
    unittest.main()
