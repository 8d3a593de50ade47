/**
 * The sqlite driver on its own: real SQL on copies of the real Chinook
 * database, real worker threads, real files. No cache is involved.
 */
import { createHash } from "node:crypto";
import { existsSync } from "node:fs";
import { readFile, readdir } from "node:fs/promises";
import path from "node:path";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import {
	CHINOOK_PATH,
	SqlEngine,
	SqliteSandbox,
	defaultSqlMutates,
	queryOf,
	sqliteFactory,
	type SqliteOptions,
} from "../../host/drivers/sqlite.ts";
import { cleanTmp, tmp } from "./helpers.ts";

let root: string;
let engine: SqlEngine;
let seedHash: string;
const sql = (query: string, extra: Record<string, unknown> = {}) => ({
	tool: "sql",
	args: { query, ...extra },
});
const sha256 = async (file: string) =>
	createHash("sha256")
		.update(await readFile(file))
		.digest("hex");
const RUNAWAY =
	"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c)";

beforeAll(async () => {
	seedHash = await sha256(CHINOOK_PATH);
	root = await tmp("sqlite");
	engine = new SqlEngine({ threads: 2 });
});
afterAll(async () => {
	await engine.close();
	await cleanTmp();
});

async function started(options: Partial<SqliteOptions> = {}) {
	const sb = new SqliteSandbox({ root, engine, ...options });
	await sb.start();
	return sb;
}

async function output(sb: SqliteSandbox, query: string) {
	const r = await sb.exec(sql(query));
	expect(r.exitCode, r.output).toBe(0);
	return r.output;
}

describe("SqliteSandbox", () => {
	it("answers a real Chinook query with a header line and its rows", async () => {
		const sb = await started();
		const r = await sb.exec(sql("SELECT Name FROM Artist WHERE ArtistId = 1"));
		expect(r).toMatchObject({
			output: "Name\nAC/DC\n",
			exitCode: 0,
			timedOut: false,
		});
		expect(r.execMs).toBeGreaterThan(0);
		await sb.stop();
	});

	it("takes the SQL as a plain string too", async () => {
		const sb = await started();
		const r = await sb.exec({
			tool: "sql",
			args: "SELECT count(*) AS n FROM Track",
		});
		expect(r.output).toBe("n\n3503\n");
		await sb.stop();
	});

	it("keeps columns of the same name apart, in order, and writes NULL, reals and blobs plainly", async () => {
		const sb = await started();
		expect(
			await output(
				sb,
				"SELECT ar.Name, t.Name, t.Composer, al.AlbumId / 2.0, x'00ff' " +
					"FROM Artist ar JOIN Album al USING (ArtistId) " +
					"JOIN Track t USING (AlbumId) " +
					"WHERE t.TrackId IN (1, 63) ORDER BY t.TrackId",
			),
		).toBe(
			"Name|Name|Composer|al.AlbumId / 2.0|x'00ff'\n" +
				"AC/DC|For Those About To Rock (We Salute You)|Angus Young, Malcolm Young, Brian Johnson|0.5|x'00FF'\n" +
				"Antônio Carlos Jobim|Desafinado|NULL|4.0|x'00FF'\n",
		);
		await sb.stop();
	});

	it("gives the header of an empty result, and the change count of a write", async () => {
		const sb = await started();
		expect(await output(sb, "SELECT * FROM Genre WHERE 0")).toBe(
			"GenreId|Name\n",
		);
		expect(await output(sb, "UPDATE Genre SET Name = upper(Name)")).toBe(
			"changes: 25\n",
		);
		await sb.stop();
	});

	it("sees its own INSERT in later SELECTs, while a fork taken before it does not and the seed never changes", async () => {
		const sb = await started();
		const before = await sb.fork();
		expect(
			await output(sb, "INSERT INTO Artist (Name) VALUES ('Trellis Trio')"),
		).toBe("changes: 1\n");
		const after = await sb.fork();
		const q = "SELECT count(*) FROM Artist WHERE Name = 'Trellis Trio'";
		expect(await output(sb, q)).toBe("count(*)\n1\n");
		expect(await output(after, q)).toBe("count(*)\n1\n");
		expect(await output(before, q)).toBe("count(*)\n0\n");
		// Forks are independent from then on, both ways.
		await output(
			before,
			"UPDATE Artist SET Name = 'Changed' WHERE ArtistId = 1",
		);
		expect(await output(sb, "SELECT Name FROM Artist WHERE ArtistId = 1")).toBe(
			"Name\nAC/DC\n",
		);
		const fresh = await started();
		expect(await output(fresh, q)).toBe("count(*)\n0\n");
		expect(await sha256(CHINOOK_PATH)).toBe(seedHash);
		await Promise.all([sb, before, after, fresh].map((s) => s.stop()));
	});

	it("round-trips its state through a snapshot into another sandbox and over a changed one", async () => {
		const factory = sqliteFactory({ root, engine });
		const sb = (await factory.start()) as SqliteSandbox;
		await output(sb, "INSERT INTO Genre (Name) VALUES ('Snapshot Core')");
		const snap = await sb.snapshot();
		expect(snap.driver).toBe("sqlite");
		expect(Buffer.from(snap.data).equals(await readFile(sb.file))).toBe(true);
		const source = {
			ref: { driver: "sqlite", key: "k", bytes: snap.data.length },
			read: async () => snap.data,
		};
		const q = "SELECT Name FROM Genre WHERE GenreId = 26";
		const restored = (await factory.restore(source)) as SqliteSandbox;
		expect(await output(restored, q)).toBe("Name\nSnapshot Core\n");
		// Restoring over a sandbox replaces whatever it had become.
		await output(sb, "DELETE FROM Genre WHERE GenreId = 26");
		await output(sb, "DROP TABLE PlaylistTrack");
		await sb.restore(source);
		expect(await output(sb, q)).toBe("Name\nSnapshot Core\n");
		expect(await output(sb, "SELECT count(*) FROM PlaylistTrack")).toBe(
			"count(*)\n8715\n",
		);
		await Promise.all([sb.stop(), restored.stop()]);
	});

	it("refuses a snapshot of another driver and bytes that are not a database", async () => {
		const sb = await started();
		await expect(
			sb.restore({
				ref: { driver: "workspace", key: "k", bytes: 1 },
				read: async () => new Uint8Array([1]),
			}),
		).rejects.toThrow(/cannot restore a workspace snapshot/);
		await expect(
			sb.restoreBytes(new TextEncoder().encode("not a database at all")),
		).rejects.toThrow(/not a SQLite database/);
		expect(await output(sb, "SELECT count(*) FROM Artist")).toBe(
			"count(*)\n275\n",
		);
		await sb.stop();
	});

	it("reports SQL errors as output with exit code 1 and changes nothing", async () => {
		const sb = await started();
		const cases: [string, RegExp][] = [
			["SELECT * FROM Nope", /^Error: no such table: Nope\n$/],
			["SELEC 1", /^Error: .*syntax error/],
			[
				"INSERT INTO Artist (ArtistId, Name) VALUES (1, 'Again')",
				/^Error: UNIQUE constraint failed: Artist.ArtistId/,
			],
			[
				"INSERT INTO Artist (Name) VALUES ('A'); DELETE FROM Artist",
				/^Error: only one statement at a time \(got 2\)/,
			],
			["  -- nothing\n", /^Error: no SQL statement/],
			["ATTACH DATABASE 'x.db' AS x", /^Error: ATTACH and DETACH/],
			["VACUUM INTO 'copy.db'", /^Error: VACUUM INTO/],
		];
		for (const [query, message] of cases) {
			const r = await sb.exec(sql(query));
			expect(r.exitCode, query).toBe(1);
			expect(r.output, query).toMatch(message);
		}
		expect(await output(sb, "SELECT count(*), max(Name) FROM Artist")).toBe(
			"count(*)|max(Name)\n275|Zeca Pagodinho\n",
		);
		expect(existsSync("x.db")).toBe(false);
		expect(existsSync("copy.db")).toBe(false);
		expect(await readdir(sb.dir)).toEqual(["db.sqlite"]);
		await sb.stop();
	});

	it("refuses a tool it does not run and args it cannot read", async () => {
		const sb = await started();
		await expect(sb.exec({ tool: "bash", args: "ls" })).rejects.toThrow(
			/does not run tool bash/,
		);
		await expect(sb.exec({ tool: "sql", args: { q: 1 } })).rejects.toThrow(
			/args must be an SQL string/,
		);
		await sb.stop();
	});

	it("stops a runaway write at its time limit with exit code 124 and keeps the database as it was", async () => {
		const sb = await started({ timeoutMs: 60_000 });
		const t0 = Date.now();
		const r = await sb.exec(
			sql(`INSERT INTO Artist (Name) ${RUNAWAY} SELECT 'n' || x FROM c`, {
				timeoutMs: 300,
			}),
		);
		expect(Date.now() - t0).toBeLessThan(10_000);
		expect(r).toMatchObject({
			exitCode: 124,
			timedOut: true,
			output: "[timed out after 300 ms]\n",
		});
		expect(await output(sb, "SELECT count(*) FROM Artist")).toBe(
			"count(*)\n275\n",
		);
		expect(await output(sb, "PRAGMA integrity_check")).toBe(
			"integrity_check\nok\n",
		);
		// Nothing of the killed statement is left beside the database.
		expect(await readdir(sb.dir)).toEqual(["db.sqlite"]);
		await sb.stop();
	});

	it("stops a runaway read at the limit the host passes, and the sandbox goes on working", async () => {
		const sb = await started();
		const r = await sb.exec(sql(`${RUNAWAY} SELECT count(*) FROM c`), {
			timeoutMs: 200,
		});
		expect(r.exitCode).toBe(124);
		expect(r.timedOut).toBe(true);
		expect(await output(sb, "SELECT Name FROM Genre WHERE GenreId = 1")).toBe(
			"Name\nRock\n",
		);
		await sb.stop();
	});

	it("takes the shorter of the call's own time limit and the host's, so a call cannot outlast the host", async () => {
		const sb = await started();
		const t0 = Date.now();
		const r = await sb.exec(
			sql(`${RUNAWAY} SELECT count(*) FROM c`, { timeoutMs: 60_000 }),
			{ timeoutMs: 200 },
		);
		expect(Date.now() - t0).toBeLessThan(10_000);
		expect(r).toMatchObject({
			exitCode: 124,
			timedOut: true,
			output: "[timed out after 200 ms]\n",
		});
		await sb.stop();
	}, 30_000);

	it("cuts the output at the size cap, and says so", async () => {
		const sb = await started({ maxOutputBytes: 40 });
		const r = await sb.exec(sql("SELECT Name FROM Artist ORDER BY ArtistId"));
		expect(r.exitCode).toBe(0);
		expect(r.output).toBe(
			"Name\nAC/DC\nAccept\nAerosmith\nAlanis Moris\n" +
				"[output truncated at 40 bytes]\n",
		);
		// An endless result ends at the cap, long before any time limit.
		const endless = await sb.exec(sql(`${RUNAWAY} SELECT x FROM c`), {
			timeoutMs: 30_000,
			maxOutputBytes: 1000,
		});
		expect(endless.exitCode).toBe(0);
		expect(endless.output).toMatch(/\[output truncated at 1000 bytes\]\n$/);
		await sb.stop();
	});

	it("runs more statements at once than it has threads", async () => {
		const sandboxes = await Promise.all([1, 2, 3, 4, 5].map(() => started()));
		const outputs = await Promise.all(
			sandboxes.map((sb, i) =>
				output(sb, `SELECT Name FROM Genre WHERE GenreId = ${i + 1}`),
			),
		);
		expect(outputs).toEqual([
			"Name\nRock\n",
			"Name\nJazz\n",
			"Name\nMetal\n",
			"Name\nAlternative & Punk\n",
			"Name\nRock And Roll\n",
		]);
		await Promise.all(sandboxes.map((sb) => sb.stop()));
	});

	it("removes its directory on stop, also while a statement runs, and cannot be used afterwards", async () => {
		const sb = await started();
		const dir = sb.dir;
		const running = sb.exec(
			sql(`${RUNAWAY} SELECT count(*) FROM c JOIN Artist`),
		);
		// The statement holds the binding's lock directory while it runs.
		await vi.waitFor(
			() => expect(existsSync(`${sb.file}.lock`)).toBe(true),
			// A loaded machine may take a while to start a thread.
			{ timeout: 20_000 },
		);
		const t0 = Date.now();
		await sb.stop();
		// Well before the default 30 s limit: stop ended the statement.
		expect(Date.now() - t0).toBeLessThan(10_000);
		expect((await running).exitCode).toBe(124);
		expect(existsSync(dir)).toBe(false);
		await sb.stop();
		await expect(sb.exec(sql("SELECT 1"))).rejects.toThrow(/stopped/);
	});

	it("fails to start from a missing seed and leaves nothing behind", async () => {
		const seedless = await tmp("sqlite-seedless");
		const sb = new SqliteSandbox({
			root: seedless,
			engine,
			seed: path.join(seedless, "missing.sqlite"),
		});
		await expect(sb.start()).rejects.toThrow(/ENOENT/);
		expect(await readdir(seedless)).toEqual([]);
	});
});

describe("sqlite mutates", () => {
	it("marks reads stateless and writes, other tools and bad args as state-changing", async () => {
		const sb = await started();
		const factory = sqliteFactory({ root, engine });
		const cases: [unknown, boolean][] = [
			[sql("SELECT Name FROM Artist"), false],
			[{ tool: "sql", args: "PRAGMA table_info(Track)" }, false],
			[sql("WITH a AS (SELECT 1) SELECT * FROM a"), false],
			[sql("SELECT 'DELETE FROM Artist'"), false],
			[sql("INSERT INTO Genre (Name) VALUES ('x')"), true],
			[sql("WITH a AS (SELECT 1) DELETE FROM Artist"), true],
			[sql("SELECT 1; DROP TABLE Artist"), true],
			[{ tool: "bash", args: "SELECT 1" }, true],
			[{ tool: "sql", args: { q: "SELECT 1" } }, true],
		];
		for (const [call, mutates] of cases) {
			const c = call as { tool: string; args: unknown };
			expect(sb.mutates(c), JSON.stringify(c)).toBe(mutates);
			expect(factory.mutates(c), JSON.stringify(c)).toBe(mutates);
			expect(defaultSqlMutates(c), JSON.stringify(c)).toBe(mutates);
		}
		await sb.stop();
	});

	it("runs other tool names when told to", () => {
		const call = { tool: "query", args: "SELECT 1" };
		expect(defaultSqlMutates(call)).toBe(true);
		expect(defaultSqlMutates(call, ["query"])).toBe(false);
		expect(queryOf({ tool: "sql", args: { sql: "SELECT 2" } })).toEqual({
			query: "SELECT 2",
			timeoutMs: undefined,
		});
	});
});
