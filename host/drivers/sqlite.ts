/**
 * The sqlite sandbox driver (the SkyRL-SQL workload): a sandbox is a SQLite
 * database file of its own, copied from a seed database (Chinook by
 * default), and a call is one SQL statement run against it. Its state is the
 * file; a snapshot is the file's bytes; a fork is a copy of the file.
 *
 * The engine is `node-sqlite3-wasm`: SQLite compiled to WebAssembly with a
 * virtual file system over `node:fs`, so it reads and writes the database
 * file in place (no load-and-write-back, unlike `sql.js`). It is plain
 * JavaScript and WebAssembly with no dependencies and no install script, so
 * `npm ci` installs it anywhere with only the npm registry (`better-sqlite3`
 * needs its install script approved and a prebuilt binary or a compiler;
 * `node:sqlite` is not in Node 20; Debian's `sqlite3` CLI would need an extra
 * install step in CI and a process per statement).
 *
 * WebAssembly cannot be interrupted from the outside and the binding exposes
 * neither `sqlite3_interrupt` nor a progress handler, so statements run on
 * worker threads (a small shared {@link SqlEngine}): a statement that
 * overruns its time limit is stopped by terminating its thread. A thread
 * killed mid-write leaves a hot rollback journal, and this binding's file
 * system never plays one back (its reserved-lock check sees the opener's own
 * lock directory, so no journal ever looks hot). So a statement that may
 * write runs on a copy of the file that replaces the original only when the
 * statement completes: a timeout, an abort or an error leaves the original
 * as it was. The copy is a reflink where the file system has them.
 *
 * One difference from stock SQLite remains: this build is compiled with
 * `SQLITE_DQS=0`, so a double-quoted string is always an identifier
 * (`WHERE Name = "AC/DC"` is an error: no such column), as SQLite's own
 * documentation recommends; single-quote string literals.
 *
 * Each statement opens the file, runs, and closes it: nothing about the
 * connection (temp tables, `PRAGMA` settings) outlives a call, so the file
 * is the whole state and a snapshot or fork captures all of it.
 */
import { closeSync } from "node:fs";
import {
	chmod,
	copyFile,
	mkdir,
	mkdtemp,
	readFile,
	readdir,
	readlink,
	realpath,
	rename,
	rm,
	writeFile,
} from "node:fs/promises";
import { constants as fsConstants } from "node:fs";
import { createRequire } from "node:module";
import { availableParallelism } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { Worker } from "node:worker_threads";
import {
	SQL_TOOLS,
	sqlCallMutates,
	sqlMutates,
	sqlOf,
	sqlStatements,
} from "../../core/classify.ts";
import {
	sandboxFactory,
	type Call,
	type ExecResult,
	type Sandbox,
	type SandboxFactory,
	type SnapshotSource,
} from "../../client/sandbox.ts";
import { timeLimit } from "./workspace.ts";

/** The driver name recorded in snapshot refs. */
export const SQLITE_DRIVER = "sqlite";

const REPO_ROOT = path.resolve(
	path.dirname(fileURLToPath(import.meta.url)),
	"../..",
);

/**
 * The real Chinook database beside the repository. Read-only: sandboxes get
 * copies of it and nothing ever opens it with SQLite.
 */
export const CHINOOK_PATH = path.resolve(
	REPO_ROOT,
	"../shared/data/chinook.sqlite",
);

/** Seed databases by template name (`Template.name` for the sqlite driver). */
export const SQLITE_SEEDS: Readonly<Record<string, string>> = {
	chinook: CHINOOK_PATH,
};

const DEFAULT_TOOLS = SQL_TOOLS;
const DB_FILE = "db.sqlite";
// Every SQLite database file starts with these 16 bytes.
const SQLITE_HEADER = "SQLite format 3\0";

/** Options of a {@link SqliteSandbox}. */
export interface SqliteOptions {
	/** The directory sandboxes are created in (each gets its own subdirectory). */
	root: string;
	/** The database a fresh sandbox starts as; copied, never written (default {@link CHINOOK_PATH}). */
	seed?: string;
	/**
	 * A statement's time limit in ms (default 30 s) when the call gives
	 * none; a limit passed to `exec` caps the call's ({@link timeLimit}).
	 */
	timeoutMs?: number;
	/** Output kept per call, in bytes (default 1 MiB); the rest is cut off. */
	maxOutputBytes?: number;
	/** Tool names run as SQL (default `sql`). */
	tools?: readonly string[];
	/** The threads statements run on (default: one engine shared by the process). */
	engine?: SqlEngine;
	/** Whether a call changes state, when the caller does not say (default {@link defaultSqlMutates}). */
	mutates?: (call: Call) => boolean;
}

/** Limits for one call, as a host's exec request carries them. */
export interface SqlExecLimits {
	timeoutMs?: number;
	maxOutputBytes?: number;
}

/** An {@link ExecResult} that also says whether the time limit stopped it. */
export interface SqlExecResult extends ExecResult {
	timedOut: boolean;
}

/** A SQL statement as a call carries it. */
export interface SqlQuery {
	query: string;
	timeoutMs?: number;
}

/**
 * The statement of a call: `args` is the SQL itself, or
 * `{query | sql, timeoutMs?}` (SkyRL-SQL sends `{query}`).
 */
export function queryOf(call: Call): SqlQuery {
	// `sqlOf` is what the Worker reads calls with: one reading for both.
	const query = sqlOf(call.args);
	if (query === null)
		throw new TypeError(
			`${call.tool}: args must be an SQL string or {query, timeoutMs?}`,
		);
	const { timeoutMs } =
		typeof call.args === "string" ? {} : (call.args as { timeoutMs?: number });
	return { query, timeoutMs };
}

/**
 * The driver's default: a SQL call mutates unless {@link sqlMutates} is sure
 * it only reads; other tools and malformed calls mutate. The same function
 * as the Worker's ({@link sqlCallMutates}).
 */
export function defaultSqlMutates(
	call: Call,
	tools: readonly string[] = SQL_TOOLS,
): boolean {
	return sqlCallMutates(call, tools);
}

// ------------------------------------------------------------------ engine

/** What the engine gives back for one statement. */
interface EngineResult {
	output: string;
	exitCode: number;
	timedOut: boolean;
}

/** One statement for the engine to run. */
interface EngineJob {
	file: string;
	sql: string;
	timeoutMs: number;
	maxOutputBytes: number;
	/** The file is a throwaway copy: skip the on-disk journal and fsync. */
	write?: boolean;
	/** Aborting stops the statement the way a timeout does. */
	signal?: AbortSignal;
}

// The worker's code, CommonJS evaluated as is (`eval: true`), so that it
// runs the same under tsx, vitest and plain node without a build step.
// `_getColumnNames`, `_bind`, `_step`, `_getRow` and `_ptr` are the
// binding's internals (its version is pinned): its public API returns rows
// as objects keyed by column name, which loses one of two columns of the
// same name (a join's `a.Name, b.Name`), the header of an empty result, and
// whether a number was a REAL (read through the exported `cwrap`).
const WORKER_SOURCE = `
const { parentPort, workerData } = require("node:worker_threads");
const sqlite = require(workerData.module);
const { Database } = sqlite;
const SQLITE_FLOAT = 2;
const columnType = sqlite.cwrap("sqlite3_column_type", "number", [
	"number",
	"number",
]);

function cell(v, type) {
	if (v === null) return "NULL";
	if (v instanceof Uint8Array)
		return "x'" + Buffer.from(v).toString("hex").toUpperCase() + "'";
	// A REAL keeps its point (4.0, not 4), as SQLite's shell and Python
	// print it, so a REAL and an INTEGER column read differently.
	if (type === SQLITE_FLOAT && Number.isInteger(v) && Math.abs(v) < 1e16)
		return v.toFixed(1);
	return String(v);
}

function run(file, sql, cap, write) {
	let db, stmt;
	try {
		db = new Database(file, { fileMustExist: true });
		// This build turns both on by default; stock SQLite (its shell,
		// Python's sqlite3, which SkyRL-SQL uses) has them off.
		db.exec("PRAGMA foreign_keys = OFF; PRAGMA recursive_triggers = OFF");
		// A write runs on a copy that is thrown away unless the statement
		// completes, so neither a journal on disk nor fsync protects anything.
		if (write) db.exec("PRAGMA journal_mode = MEMORY; PRAGMA synchronous = OFF");
		stmt = db.prepare(sql);
		const names = stmt._getColumnNames();
		if (names.length === 0) {
			const { changes } = stmt.run();
			return { output: "changes: " + changes + "\\n", exitCode: 0 };
		}
		const keys = names.map((_, i) => "c" + i);
		stmt._bind(undefined);
		let out = names.join("|") + "\\n";
		let bytes = Buffer.byteLength(out);
		// Stop reading rows at the cap: a query over an endless recursive
		// CTE then ends at once instead of at its time limit. Writes with
		// RETURNING are done by the first step, so stopping early is safe.
		while (bytes <= cap && stmt._step()) {
			const types = keys.map((_, i) => columnType(stmt._ptr, i));
			const row = stmt._getRow(keys, false);
			const line = keys.map((k, i) => cell(row[k], types[i])).join("|") + "\\n";
			bytes += Buffer.byteLength(line);
			out += line;
		}
		if (bytes > cap)
			out =
				Buffer.from(out).subarray(0, cap).toString() +
				"\\n[output truncated at " + cap + " bytes]\\n";
		return { output: out, exitCode: 0 };
	} catch (err) {
		return {
			output: "Error: " + (err && err.message ? err.message : String(err)) + "\\n",
			exitCode: 1,
		};
	} finally {
		try { if (stmt && !stmt.isFinalized) stmt.finalize(); } catch {}
		try { if (db && db.isOpen) db.close(); } catch {}
	}
}

parentPort.on("message", (job) => {
	parentPort.postMessage(run(job.file, job.sql, job.maxOutputBytes, job.write));
});
parentPort.postMessage("ready");
`;

interface Thread {
	worker: Worker;
}

/**
 * Worker threads that run SQL statements, at most `threads` at a time;
 * statements beyond that wait their turn. A thread whose statement overruns
 * its time limit is terminated and replaced. Idle threads do not keep the
 * process alive.
 */
export class SqlEngine {
	readonly #max: number;
	#live = 0;
	#idle: Thread[] = [];
	#waiting: ((thread: Thread | Error) => void)[] = [];
	#closed = false;

	/** Starts no thread until a statement needs one. */
	constructor(options: { threads?: number } = {}) {
		this.#max = Math.max(1, options.threads ?? defaultThreads());
	}

	/**
	 * Runs one statement on a thread. Errors of SQL are results
	 * (`exitCode` 1); a timeout or an abort gives `timedOut` and exit code
	 * 124 and leaves the file as the terminated thread left it, for the
	 * caller to recover.
	 */
	async run(job: EngineJob): Promise<EngineResult> {
		const thread = await this.#acquire();
		const { worker } = thread;
		worker.ref();
		let done = false;
		let timer: NodeJS.Timeout | undefined;
		let onAbort: (() => void) | undefined;
		try {
			const result = await new Promise<EngineResult>((resolve, reject) => {
				const stop = () => {
					if (done) return;
					done = true;
					resolve({ output: "", exitCode: 124, timedOut: true });
				};
				timer = setTimeout(stop, job.timeoutMs);
				onAbort = stop;
				job.signal?.addEventListener("abort", onAbort);
				if (job.signal?.aborted) stop();
				worker.once("message", (m: { output: string; exitCode: number }) => {
					if (done) return;
					done = true;
					resolve({ output: m.output, exitCode: m.exitCode, timedOut: false });
				});
				worker.once("error", (err) => {
					if (done) return;
					done = true;
					reject(err);
				});
				worker.postMessage({
					file: job.file,
					sql: job.sql,
					maxOutputBytes: job.maxOutputBytes,
					write: job.write === true,
				});
			});
			if (result.timedOut) await this.#discard(thread);
			else this.#release(thread);
			return result;
		} catch (err) {
			await this.#discard(thread);
			throw err;
		} finally {
			clearTimeout(timer);
			if (onAbort) job.signal?.removeEventListener("abort", onAbort);
		}
	}

	/** Terminates every idle thread; running statements finish first. */
	async close(): Promise<void> {
		this.#closed = true;
		const idle = this.#idle.splice(0);
		await Promise.all(idle.map((t) => this.#discard(t)));
		for (const wake of this.#waiting.splice(0))
			wake(new Error("the SQL engine is closed"));
	}

	async #acquire(): Promise<Thread> {
		if (this.#closed) throw new Error("the SQL engine is closed");
		const idle = this.#idle.pop();
		if (idle) return idle;
		if (this.#live < this.#max) {
			this.#live++;
			try {
				return await spawnThread();
			} catch (err) {
				this.#live--;
				this.#wakeOne();
				throw err;
			}
		}
		const got = await new Promise<Thread | Error>((resolve) =>
			this.#waiting.push(resolve),
		);
		if (got instanceof Error) throw got;
		return got;
	}

	#release(thread: Thread): void {
		thread.worker.removeAllListeners("message");
		thread.worker.removeAllListeners("error");
		const wake = this.#waiting.shift();
		if (wake) return wake(thread);
		if (this.#closed) {
			void this.#discard(thread);
			return;
		}
		thread.worker.unref();
		this.#idle.push(thread);
	}

	async #discard(thread: Thread): Promise<void> {
		thread.worker.removeAllListeners("message");
		thread.worker.removeAllListeners("error");
		// An error listener stays, so a late error of a dying thread is not
		// an uncaught exception.
		thread.worker.on("error", () => {});
		await thread.worker.terminate();
		this.#live--;
		this.#wakeOne();
	}

	/** Lets a waiter start a thread of its own in a freed slot. */
	#wakeOne(): void {
		const wake = this.#waiting.shift();
		if (!wake) return;
		this.#acquire().then(wake, (err: Error) => wake(err));
	}
}

function defaultThreads(): number {
	return Math.min(4, availableParallelism());
}

const requireHere = createRequire(import.meta.url);

async function spawnThread(): Promise<Thread> {
	const worker = new Worker(WORKER_SOURCE, {
		eval: true,
		workerData: { module: requireHere.resolve("node-sqlite3-wasm") },
	});
	await new Promise<void>((resolve, reject) => {
		worker.once("message", () => resolve());
		worker.once("error", reject);
		worker.once("exit", (code) =>
			reject(new Error(`SQL thread exited with code ${code} while starting`)),
		);
	});
	worker.removeAllListeners("exit");
	worker.removeAllListeners("error");
	return { worker };
}

let sharedEngine: SqlEngine | undefined;

/** The engine sandboxes use when their options name none. */
export function defaultSqlEngine(): SqlEngine {
	sharedEngine ??= new SqlEngine();
	return sharedEngine;
}

// ----------------------------------------------------------------- sandbox

/** A sandbox that is a SQLite database file; see the module comment. */
export class SqliteSandbox implements Sandbox {
	readonly driver = SQLITE_DRIVER;
	readonly #options: SqliteOptions;
	#dir: string | null = null;
	#stopped = false;
	/** Serializes statements, forks, snapshots and restores of this file. */
	#queue: Promise<unknown> = Promise.resolve();
	/** Aborts the running statement when the sandbox stops. */
	#abort = new AbortController();

	/** Creates nothing: `start()` copies the seed. */
	constructor(options: SqliteOptions) {
		this.#options = options;
	}

	/** The sandbox's directory; only once started. */
	get dir(): string {
		if (this.#dir === null)
			throw new Error("the sqlite sandbox is not started");
		return this.#dir;
	}

	/** The sandbox's database file; only once started. */
	get file(): string {
		return path.join(this.dir, DB_FILE);
	}

	/** Creates the sandbox's directory with a copy of the seed database. */
	async start(): Promise<void> {
		await this.#create(this.#options.seed ?? CHINOOK_PATH);
	}

	/**
	 * Runs the call's one statement and returns its rows as text: a header
	 * line of column names, then one line per row, values separated by `|`
	 * (NULL as `NULL`, blobs as `x'…'`). A statement without result columns
	 * gives `changes: N`. SQL errors, several statements in one call, and
	 * statements that would reach outside the file (ATTACH, VACUUM INTO) give
	 * `Error: …` and exit code 1; a timeout gives exit code 124.
	 */
	async exec(call: Call, limits: SqlExecLimits = {}): Promise<SqlExecResult> {
		const tools = this.#options.tools ?? DEFAULT_TOOLS;
		if (!tools.includes(call.tool))
			throw new TypeError(`the sqlite driver does not run tool ${call.tool}`);
		const { query, timeoutMs: callTimeout } = queryOf(call);
		const timeoutMs = timeLimit(
			callTimeout,
			limits.timeoutMs,
			this.#options.timeoutMs ?? 30_000,
		);
		const maxOutputBytes =
			limits.maxOutputBytes ?? this.#options.maxOutputBytes ?? 1 << 20;
		return this.#serial(async () => {
			const started = performance.now();
			const refused = refusal(query);
			if (refused !== null)
				return {
					output: `Error: ${refused}\n`,
					exitCode: 1,
					timedOut: false,
					execMs: performance.now() - started,
				};
			const statement = sqlStatements(query)[0]!;
			const result = sqlMutates(statement)
				? await this.#write(statement, timeoutMs, maxOutputBytes)
				: await this.#read(statement, timeoutMs, maxOutputBytes);
			if (result.timedOut)
				result.output += `[timed out after ${timeoutMs} ms]\n`;
			return { ...result, execMs: performance.now() - started };
		});
	}

	/** A copy of the database file as a new, started sandbox. */
	async fork(): Promise<SqliteSandbox> {
		return this.#serial(async () => {
			const twin = new SqliteSandbox(this.#options);
			await twin.#create(this.file);
			return twin;
		});
	}

	/** The database file's bytes. */
	async snapshot(): Promise<{ driver: string; data: Uint8Array }> {
		return this.#serial(async () => ({
			driver: this.driver,
			data: await readFile(this.file),
		}));
	}

	/** Replaces the database with a sqlite snapshot's. */
	async restore(source: SnapshotSource): Promise<void> {
		if (source.ref.driver !== this.driver)
			throw new TypeError(`cannot restore a ${source.ref.driver} snapshot`);
		await this.restoreBytes(await source.read());
	}

	/** Replaces the database file with these bytes, which must be a SQLite database. */
	async restoreBytes(data: Uint8Array): Promise<void> {
		const header = Buffer.from(
			data.buffer,
			data.byteOffset,
			Math.min(data.byteLength, 16),
		);
		if (header.toString("latin1") !== SQLITE_HEADER)
			throw new TypeError("the snapshot is not a SQLite database");
		await this.start();
		await this.#serial(async () => {
			// Write beside the file and rename over it: a reader never sees
			// half a database, and a failed write leaves the old one.
			const temp = `${this.file}.restore`;
			await writeFile(temp, data);
			await rename(temp, this.file);
			await rm(`${this.file}-journal`, { force: true });
		});
	}

	/** Stops a running statement and removes the directory. Idempotent. */
	async stop(): Promise<void> {
		this.#stopped = true;
		this.#abort.abort();
		// Wait for the statement to let go of the file before removing it.
		await this.#queue.catch(() => {});
		const dir = this.#dir;
		this.#dir = null;
		if (dir !== null) await rm(dir, { recursive: true, force: true });
	}

	/** See {@link SqliteOptions.mutates}. */
	mutates(call: Call): boolean {
		return this.#options.mutates
			? this.#options.mutates(call)
			: defaultSqlMutates(call, this.#options.tools ?? DEFAULT_TOOLS);
	}

	async #create(from: string): Promise<void> {
		if (this.#stopped) throw new Error("the sqlite sandbox is stopped");
		if (this.#dir !== null) return;
		await mkdir(this.#options.root, { recursive: true });
		const dir = await mkdtemp(path.join(this.#options.root, "sql-"));
		try {
			const file = path.join(dir, DB_FILE);
			// A reflink where the file system has them, a plain copy where not.
			await copyFile(from, file, fsConstants.COPYFILE_FICLONE);
			// The copy keeps the source's mode, and the seed is read-only.
			await chmod(file, 0o644);
		} catch (err) {
			await rm(dir, { recursive: true, force: true });
			throw err;
		}
		this.#dir = dir;
	}

	#engine(): SqlEngine {
		return this.#options.engine ?? defaultSqlEngine();
	}

	#serial<T>(fn: () => Promise<T>): Promise<T> {
		const next = this.#queue.then(() => {
			if (this.#stopped) throw new Error("the sqlite sandbox is stopped");
			return fn();
		});
		this.#queue = next.catch(() => {});
		return next;
	}

	/** Runs a statement that cannot change the file on the file itself. */
	async #read(
		sql: string,
		timeoutMs: number,
		maxOutputBytes: number,
	): Promise<EngineResult> {
		const file = this.file;
		const result = await this.#engine().run({
			file,
			sql,
			timeoutMs,
			maxOutputBytes,
			signal: this.#abort.signal,
		});
		if (result.timedOut) await releaseAfterKill(file);
		return result;
	}

	/**
	 * Runs a statement that may write on a copy of the file, and puts the
	 * copy in place only when it completed (see the module comment).
	 * A statement that failed with an SQL error was rolled back by SQLite,
	 * so its copy equals the original and is dropped.
	 */
	async #write(
		sql: string,
		timeoutMs: number,
		maxOutputBytes: number,
	): Promise<EngineResult> {
		const file = this.file;
		const work = `${file}.next`;
		await copyFile(file, work, fsConstants.COPYFILE_FICLONE);
		let result: EngineResult | undefined;
		try {
			result = await this.#engine().run({
				file: work,
				sql,
				timeoutMs,
				maxOutputBytes,
				write: true,
				signal: this.#abort.signal,
			});
			if (result.exitCode === 0 && !result.timedOut) await rename(work, file);
			return result;
		} finally {
			if (result?.timedOut !== false) await releaseAfterKill(work);
			await rm(work, { force: true });
			await rm(`${work}-journal`, { force: true });
		}
	}
}

/**
 * Lets go of a file whose statement's thread was terminated. Threads share
 * the process's descriptors and a terminated one does not close what it
 * opened; and the binding locks a file by creating `<file>.lock`, a
 * directory that would make every later open of the file busy.
 */
async function releaseAfterKill(file: string): Promise<void> {
	await closeDescriptorsOf([file, `${file}-journal`]);
	await rm(`${file}.lock`, { recursive: true, force: true });
}

/**
 * Why the driver refuses a query without running it, or null. One statement
 * per call, as Python's `sqlite3` (which SkyRL-SQL uses) insists; and
 * nothing that reaches files beside the sandbox's own database.
 */
function refusal(query: string): string | null {
	// The binding hands SQLite a C string, which would end at a NUL.
	if (query.includes("\0")) return "the SQL text contains a NUL character";
	const statements = sqlStatements(query);
	if (statements.length === 0) return "no SQL statement";
	if (statements.length > 1)
		return `only one statement at a time (got ${statements.length})`;
	const statement = statements[0]!;
	if (/^(ATTACH|DETACH)\b/i.test(statement))
		return "ATTACH and DETACH are not available: a sandbox is one database";
	if (/^VACUUM\b/i.test(statement) && /\bINTO\b/i.test(statement))
		return "VACUUM INTO is not available: a sandbox is one database";
	return null;
}

/**
 * Closes this process's descriptors that point at any of `files`: a
 * terminated worker thread does not close what it opened. Linux only (it
 * reads `/proc/self/fd`); elsewhere the descriptors leak until the process
 * ends, one set per timed-out statement.
 */
async function closeDescriptorsOf(files: string[]): Promise<void> {
	let entries: string[];
	try {
		entries = await readdir("/proc/self/fd");
	} catch {
		return;
	}
	// The links name real paths: resolve symbolic links in ours too.
	const wanted = new Set<string>();
	for (const file of files) {
		const dir = await realpath(path.dirname(file)).catch(() => null);
		if (dir !== null) wanted.add(path.join(dir, path.basename(file)));
	}
	for (const entry of entries) {
		try {
			if (wanted.has(await readlink(`/proc/self/fd/${entry}`)))
				closeSync(Number(entry));
		} catch {
			// Gone meanwhile, or not a link.
		}
	}
}

/**
 * A sandbox factory of sqlite sandboxes under `options.root`, each starting
 * as a copy of `options.seed`.
 */
export function sqliteFactory(options: SqliteOptions): SandboxFactory {
	return sandboxFactory(() => new SqliteSandbox(options), {
		driver: SQLITE_DRIVER,
	});
}
