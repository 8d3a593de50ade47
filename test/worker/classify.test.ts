/**
 * The SQL classifier runs here, inside workerd, because the Worker uses it in
 * managed mode to fill in `mutates` before a lookup: the ids it computes must
 * be the ones the host's sqlite driver computes for the same call.
 */
import { describe, expect, it } from "vitest";
import {
	sqlCallMutates,
	sqlMutates,
	sqlOf,
	sqlStatements,
} from "../../core/classify.ts";

const reads: string[] = [
	"SELECT Name FROM Artist WHERE ArtistId = 1",
	"select name from artist",
	"   \n\tSELECT 1",
	"SELECT 1;",
	"SELECT 1;  -- done\n",
	"(SELECT 1)",
	"((select 1))",
	"SELECT 'DELETE'",
	"SELECT 'it''s; DROP TABLE t'",
	'SELECT "delete", [drop], `update` FROM t',
	"-- drop\nSELECT 1",
	"/* DELETE FROM t; */ SELECT 1",
	// SQLite lets a block comment run to the end of the text.
	"SELECT 1 /* DELETE FROM t",
	"SELECT replace(Name, 'a', 'b') FROM Artist",
	"SELECT updated_at, deleted FROM t",
	"SELECT * FROM pragma_table_info('Artist')",
	"WITH x AS (SELECT 1) SELECT * FROM x",
	"with recursive c(n) as (select 1 union all select n + 1 from c where n < 5) select n from c",
	"VALUES (1, 'a'), (2, 'b')",
	"EXPLAIN SELECT * FROM Artist",
	"EXPLAIN QUERY PLAN SELECT * FROM Track WHERE AlbumId = 3",
	"EXPLAIN DELETE FROM Artist",
	"PRAGMA table_info(Artist)",
	"pragma main.index_list('Track')",
	"PRAGMA table_list",
	"PRAGMA user_version",
	"PRAGMA foreign_key_list(Track);",
];

const writes: string[] = [
	"INSERT INTO Artist (Name) VALUES ('X')",
	"update Artist set Name = 'Y' where ArtistId = 1",
	"DELETE FROM Artist",
	"REPLACE INTO Artist VALUES (1, 'Z')",
	"CREATE TABLE t (a)",
	"DROP TABLE Artist",
	"ALTER TABLE Artist ADD COLUMN x",
	"ATTACH DATABASE 'other.db' AS other",
	"DETACH DATABASE other",
	"VACUUM",
	"REINDEX",
	"ANALYZE",
	"BEGIN",
	"COMMIT",
	"SAVEPOINT s",
	"PRAGMA user_version = 3",
	"PRAGMA journal_mode = WAL",
	"PRAGMA writable_schema",
	"WITH x AS (SELECT 1) DELETE FROM t",
	"WITH x AS (SELECT 1) INSERT INTO t SELECT * FROM x",
	"WITH x AS (SELECT 1) REPLACE INTO t SELECT * FROM x",
	"WITH x AS (DELETE FROM t RETURNING *) SELECT 1",
	"select 1; drop table t",
	"SELECT 1; SELECT 2",
	"SELECT * FROM t; -- x\nDELETE FROM t",
	"SELECT 'unterminated",
	"",
	"   ",
	"-- only a comment",
	";",
	"frobnicate the database",
	"42",
];

describe("sqlMutates", () => {
	it.each(reads)("says %j does not change the database", (sql) => {
		expect(sqlMutates(sql)).toBe(false);
	});

	it.each(writes)("says %j may change the database", (sql) => {
		expect(sqlMutates(sql)).toBe(true);
	});
});

describe("sqlStatements", () => {
	it("splits at semicolons outside literals and comments, dropping empty statements", () => {
		expect(
			sqlStatements("SELECT ';' ; -- a; b\n;; /* c; */ DELETE FROM t;"),
		).toEqual(["SELECT ';'", "DELETE FROM t"]);
	});

	it("keeps a trigger's body together with its semicolons", () => {
		const trigger =
			"CREATE TEMP TRIGGER tr AFTER INSERT ON t BEGIN " +
			"UPDATE t SET a = 1; DELETE FROM u; END";
		expect(sqlStatements(`${trigger}; SELECT 1`)).toEqual([
			trigger,
			"SELECT 1",
		]);
	});

	it("finds no statement in whitespace and comments", () => {
		expect(sqlStatements("  -- nothing\n/* here */ ;")).toEqual([]);
	});
});

describe("sqlCallMutates", () => {
	it("reads a SQL call the way the sqlite driver does: a string, {query} or {sql}", () => {
		expect(sqlOf("SELECT 1")).toBe("SELECT 1");
		expect(sqlOf({ query: "SELECT 2", timeoutMs: 5 })).toBe("SELECT 2");
		expect(sqlOf({ sql: "SELECT 3" })).toBe("SELECT 3");
		for (const bad of [null, 1, ["SELECT 1"], { q: "x" }, { query: 1 }])
			expect(sqlOf(bad), JSON.stringify(bad)).toBeNull();
		expect(sqlOf({ query: "SELECT 1", timeoutMs: "5" })).toBeNull();
	});

	it("says a read of a SQL tool is stateless, and anything else changes state", () => {
		expect(sqlCallMutates({ tool: "sql", args: { query: "SELECT 1" } })).toBe(
			false,
		);
		expect(sqlCallMutates({ tool: "sql", args: "DELETE FROM t" })).toBe(true);
		expect(sqlCallMutates({ tool: "bash", args: "SELECT 1" })).toBe(true);
		expect(sqlCallMutates({ tool: "sql", args: { q: "SELECT 1" } })).toBe(true);
		expect(sqlCallMutates({ tool: "sql" })).toBe(true);
		expect(sqlCallMutates({ tool: "query", args: "SELECT 1" }, ["query"])).toBe(
			false,
		);
	});
});
