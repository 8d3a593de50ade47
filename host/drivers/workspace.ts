/**
 * The workspace sandbox driver: a sandbox is a real directory under a root
 * directory, and a call is a `bash -c` command run in it. Its state is the
 * directory's files; snapshots are gzipped tarballs of them.
 *
 * A workspace isolates state, not processes: commands run as this user and
 * can reach anything the user can. Use it for trusted commands, tests and
 * local runs; the container host's Docker driver is the security boundary.
 *
 * This module stays free of HTTP: snapshots go out and come in as bytes, and
 * whoever holds a cache client (the executor, the host) moves them.
 */
import { execFile, spawn } from "node:child_process";
import { mkdir, mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { constants } from "node:os";
import path from "node:path";
import { promisify } from "node:util";
import { create as createTar, extract as extractTar } from "tar";
import {
	sandboxFactory,
	type Call,
	type ExecResult,
	type Sandbox,
	type SandboxFactory,
	type SnapshotSource,
} from "../../client/sandbox.ts";

const run = promisify(execFile);

/** The driver name recorded in snapshot refs. */
export const WORKSPACE_DRIVER = "workspace";

/** Options of a {@link WorkspaceSandbox}. */
export interface WorkspaceOptions {
	/** The directory sandboxes are created in (each gets its own subdirectory). */
	root: string;
	/** A command's time limit in ms (default 60 s); a call may lower or raise it. */
	timeoutMs?: number;
	/** Output kept per call, in bytes (default 1 MiB); the rest is cut off. */
	maxOutputBytes?: number;
	/** Environment variables for commands, on top of a small fixed set. */
	env?: Record<string, string>;
	/** Tool names run as shell commands (default `bash`, `sh`, `shell`). */
	tools?: readonly string[];
	/** Whether a call changes state, when the caller does not say (default {@link defaultMutates}). */
	mutates?: (call: Call) => boolean;
}

/** A shell command as a call carries it. */
export interface Command {
	cmd: string;
	/** A directory inside the workspace, relative to it. */
	cwd?: string;
	timeoutMs?: number;
}

/**
 * The command of a call: `args` is the command itself, or
 * `{cmd | command, cwd?, timeoutMs?}`.
 */
export function commandOf(call: Call): Command {
	const args = call.args;
	if (typeof args === "string") return { cmd: args };
	if (args !== null && typeof args === "object" && !Array.isArray(args)) {
		const a = args as Record<string, unknown>;
		const cmd = a.cmd ?? a.command;
		if (typeof cmd === "string") {
			if (a.cwd !== undefined && typeof a.cwd !== "string")
				throw new TypeError("a command's cwd must be a string");
			if (a.timeoutMs !== undefined && typeof a.timeoutMs !== "number")
				throw new TypeError("a command's timeoutMs must be a number");
			return {
				cmd,
				cwd: a.cwd as string | undefined,
				timeoutMs: a.timeoutMs as number | undefined,
			};
		}
	}
	throw new TypeError(
		`${call.tool}: args must be a command string or {cmd, cwd?, timeoutMs?}`,
	);
}

const READ_ONLY = new Set([
	"cat",
	"ls",
	"head",
	"tail",
	"wc",
	"grep",
	"egrep",
	"fgrep",
	"rg",
	"find",
	"stat",
	"file",
	"pwd",
	"echo",
	"printf",
	"sha256sum",
	"sha1sum",
	"md5sum",
	"cksum",
	"diff",
	"cmp",
	"du",
	"tree",
	"sort",
	"uniq",
	"cut",
	"tr",
	"jq",
	"which",
	"true",
	"test",
	"basename",
	"dirname",
	"realpath",
	"nl",
	"od",
	"xxd",
]);
const READ_ONLY_GIT = new Set([
	"status",
	"log",
	"diff",
	"show",
	"ls-files",
	"rev-parse",
	"blame",
]);

/**
 * Whether a shell command only reads. Deliberately narrow: a pipeline of
 * known reading commands with no redirection, command list, substitution,
 * or writing flag. Anything else counts as state-changing, the safe side.
 */
export function looksReadOnly(cmd: string): boolean {
	if (/[>;&`\n\r]|\$\(|<\(/.test(cmd)) return false;
	return cmd.split("|").every((segment) => {
		const words = segment.trim().split(/\s+/);
		const [name, sub] = words;
		if (name === "git") return READ_ONLY_GIT.has(sub ?? "");
		if (!READ_ONLY.has(name ?? "")) return false;
		if (name === "find")
			return !words.some((w) =>
				/^-(delete|exec|execdir|ok|okdir|fprint.*|fls)$/.test(w),
			);
		if (name === "sort") return !words.some((w) => /^(-o|--output)/.test(w));
		return true;
	});
}

/** The workspace's default: a shell call mutates unless {@link looksReadOnly}; other tools mutate. */
export function defaultMutates(
	call: Call,
	tools: readonly string[] = DEFAULT_TOOLS,
): boolean {
	if (!tools.includes(call.tool)) return true;
	try {
		return !looksReadOnly(commandOf(call).cmd);
	} catch {
		return true;
	}
}

const DEFAULT_TOOLS = ["bash", "sh", "shell"] as const;

/** A sandbox that is a directory; see the module comment. */
export class WorkspaceSandbox implements Sandbox {
	readonly driver = WORKSPACE_DRIVER;
	readonly #options: WorkspaceOptions;
	#dir: string | null = null;
	#stopped = false;
	/** Process groups of running commands, killed by `stop()`. */
	#running = new Set<number>();

	/** Creates nothing: `start()` makes the directory. */
	constructor(options: WorkspaceOptions) {
		this.#options = options;
	}

	/** The sandbox's directory; only once started. */
	get dir(): string {
		if (this.#dir === null) throw new Error("the workspace is not started");
		return this.#dir;
	}

	/** Creates the sandbox's empty directory under the root. */
	async start(): Promise<void> {
		if (this.#stopped) throw new Error("the workspace is stopped");
		if (this.#dir !== null) return;
		await mkdir(this.#options.root, { recursive: true });
		this.#dir = await mkdtemp(path.join(this.#options.root, "ws-"));
	}

	/**
	 * Runs the call's command with `bash -c` in the directory: stdout and
	 * stderr through one pipe, in the order written, cut at the output cap.
	 * A timeout kills the command's process group and gives exit code 124.
	 */
	async exec(call: Call): Promise<ExecResult> {
		const tools = this.#options.tools ?? DEFAULT_TOOLS;
		if (!tools.includes(call.tool))
			throw new TypeError(
				`the workspace driver does not run tool ${call.tool}`,
			);
		const command = commandOf(call);
		const cwd = this.#inside(command.cwd ?? ".");
		const timeoutMs = command.timeoutMs ?? this.#options.timeoutMs ?? 60_000;
		const cap = this.#options.maxOutputBytes ?? 1 << 20;
		const started = performance.now();
		// The outer shell points stderr at stdout before exec'ing the
		// command's own shell: one pipe keeps the two in the order they were
		// written, which two pipes merged here could not, and the cache needs
		// the same output each time.
		const child = spawn(
			"bash",
			["-c", 'exec bash -c "$1" 2>&1', "bash", command.cmd],
			{
				cwd,
				env: {
					PATH: process.env.PATH ?? "/usr/bin:/bin",
					HOME: this.dir,
					LANG: "C.UTF-8",
					LC_ALL: "C.UTF-8",
					TERM: "dumb",
					TRELLIS_WORKSPACE: this.dir,
					...this.#options.env,
				},
				stdio: ["ignore", "pipe", "ignore"],
				detached: true,
			},
		);
		const pgid = child.pid;
		if (pgid !== undefined) this.#running.add(pgid);
		const drained = new Promise((resolve) =>
			child.stdout.once("close", resolve),
		);
		const chunks: Buffer[] = [];
		let kept = 0;
		let dropped = 0;
		child.stdout.on("data", (chunk: Buffer) => {
			const room = cap - kept;
			if (room > 0) {
				chunks.push(chunk.subarray(0, room));
				kept += Math.min(room, chunk.length);
			}
			dropped += Math.max(0, chunk.length - Math.max(room, 0));
		});
		let timedOut = false;
		const timer = setTimeout(() => {
			timedOut = true;
			killGroup(pgid);
		}, timeoutMs);
		const [code, signal] = await new Promise<
			[number | null, NodeJS.Signals | null]
		>((resolve, reject) => {
			child.on("error", reject);
			child.on("exit", (c, s) => {
				// Background jobs the command left would hold the pipe open:
				// a workspace's state is its files, not its processes.
				killGroup(pgid);
				resolve([c, s]);
			});
		}).finally(() => clearTimeout(timer));
		await drained;
		if (pgid !== undefined) this.#running.delete(pgid);
		let output = Buffer.concat(chunks).toString("utf8");
		if (dropped > 0) output += `\n[output truncated: ${dropped} more bytes]\n`;
		if (timedOut) output += `\n[timed out after ${timeoutMs} ms]\n`;
		const exitCode = timedOut
			? 124
			: (code ?? 128 + (signal ? (constants.signals[signal] ?? 0) : 0));
		return { output, exitCode, execMs: performance.now() - started };
	}

	/** A copy of the directory (`cp -a --reflink=auto`) as a new, started sandbox. */
	async fork(): Promise<WorkspaceSandbox> {
		const twin = new WorkspaceSandbox(this.#options);
		await twin.start();
		try {
			await run("cp", ["-a", "--reflink=auto", `${this.dir}/.`, twin.dir]);
		} catch (err) {
			await twin.stop();
			throw err;
		}
		return twin;
	}

	/** The directory as a gzipped tarball. */
	async snapshot(): Promise<{ driver: string; data: Uint8Array }> {
		const chunks: Buffer[] = [];
		const stream = createTar({ gzip: true, cwd: this.dir, portable: true }, [
			".",
		]);
		for await (const chunk of stream) chunks.push(chunk as Buffer);
		return { driver: this.driver, data: Buffer.concat(chunks) };
	}

	/** Writes {@link snapshot}'s tarball to a file and returns its size. */
	async snapshotTo(file: string): Promise<{ bytes: number }> {
		const { data } = await this.snapshot();
		await writeFile(file, data);
		return { bytes: data.length };
	}

	/** Replaces the directory's contents with a workspace snapshot's. */
	async restore(source: SnapshotSource): Promise<void> {
		if (source.ref.driver !== this.driver)
			throw new TypeError(`cannot restore a ${source.ref.driver} snapshot`);
		await this.restoreBytes(await source.read());
	}

	/** Restores from a tarball file {@link snapshotTo} wrote. */
	async restoreFile(file: string): Promise<void> {
		await this.restoreBytes(await readFile(file));
	}

	/** Replaces the directory's contents with a gzipped tarball's. */
	async restoreBytes(data: Uint8Array): Promise<void> {
		await this.start();
		const dir = this.dir;
		await rm(dir, { recursive: true, force: true });
		await mkdir(dir);
		await new Promise<void>((resolve, reject) => {
			// `strict` turns a damaged archive into an error, not a partial
			// restore; tar refuses entries that would land outside `cwd`.
			const unpack = extractTar({ cwd: dir, strict: true });
			unpack.on("error", reject);
			unpack.on("close", () => resolve());
			unpack.end(Buffer.from(data.buffer, data.byteOffset, data.byteLength));
		});
	}

	/** Kills running commands and removes the directory. Idempotent. */
	async stop(): Promise<void> {
		this.#stopped = true;
		for (const pgid of this.#running) killGroup(pgid);
		this.#running.clear();
		const dir = this.#dir;
		this.#dir = null;
		if (dir !== null) await rm(dir, { recursive: true, force: true });
	}

	/** See {@link WorkspaceOptions.mutates}. */
	mutates(call: Call): boolean {
		return this.#options.mutates
			? this.#options.mutates(call)
			: defaultMutates(call, this.#options.tools ?? DEFAULT_TOOLS);
	}

	/** A path inside the workspace; a `cwd` may not climb out of it. */
	#inside(relative: string): string {
		const full = path.resolve(this.dir, relative);
		if (full !== this.dir && !full.startsWith(this.dir + path.sep))
			throw new TypeError(`cwd ${relative} is outside the workspace`);
		return full;
	}
}

function killGroup(pgid: number | undefined): void {
	if (pgid === undefined) return;
	try {
		process.kill(-pgid, "SIGKILL");
	} catch {
		// Already gone.
	}
}

/** A sandbox factory of workspaces under `options.root`, for the executor. */
export function workspaceFactory(options: WorkspaceOptions): SandboxFactory {
	return sandboxFactory(() => new WorkspaceSandbox(options), {
		driver: WORKSPACE_DRIVER,
	});
}
