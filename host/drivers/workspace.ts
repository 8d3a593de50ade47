/**
 * The workspace sandbox driver: a sandbox is a real directory under a root
 * directory, and a call is a `bash -c` command run in it. Its state is the
 * directory's files; snapshots are gzipped tarballs of them.
 *
 * Isolation (`isolate`): with bubblewrap, a command sees its sandbox
 * read-write at the fixed path {@link WORKSPACE_MOUNT}, the rest of the
 * machine read-only, a private /tmp, and no network; without it, commands
 * run as this user in the sandbox's real directory and can reach anything
 * the user can. The fixed path matters to the cache as much as to safety:
 * `pwd`, compiler messages and stack traces then read the same in every
 * sandbox, so a replay in another sandbox is not a false conflict. Even
 * isolated, a workspace shares the kernel and can read the host's files;
 * the container host's Docker driver is the stronger boundary.
 *
 * This module stays free of HTTP: snapshots go out and come in as bytes, and
 * whoever holds a cache client (the executor, the host) moves them.
 */
import { execFile, spawn } from "node:child_process";
import { readFileSync, readdirSync } from "node:fs";
import {
	mkdir,
	mkdtemp,
	readFile,
	readdir,
	readlink,
	realpath,
	rm,
	writeFile,
} from "node:fs/promises";
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

/** Where an isolated command sees its sandbox, and its working directory. */
export const WORKSPACE_MOUNT = "/work";

/** How commands are isolated: `auto` uses bubblewrap when it works here. */
export type IsolateMode = "auto" | "bwrap" | "none";

/** How a started sandbox's commands actually run. */
export type Isolation = "bwrap" | "none";

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
	/**
	 * Isolation with bubblewrap (see the module comment). `auto` falls back
	 * to none, with one log line, where bubblewrap cannot run (user
	 * namespaces forbidden); `bwrap` makes `start()` fail there instead.
	 * Default `none` for now: the host and some tests have commands write
	 * to absolute paths outside the sandbox without asking for a bind.
	 */
	isolate?: IsolateMode;
	/** Absolute paths an isolated command may write, at the same path. */
	binds?: readonly string[];
	/** Whether an isolated command reaches the network (default false). */
	network?: boolean;
	/** The bubblewrap executable (default `bwrap` on the PATH). */
	bwrap?: string;
	/** Where the fallback to no isolation is reported (default `console.warn`). */
	log?: (line: string) => void;
}

/** What an exec gave, and whether the time limit stopped it. */
export interface WorkspaceExecResult extends ExecResult {
	timedOut: boolean;
}

/**
 * How long output may take to drain once a command has exited and its
 * process group is killed: only a job that left the group can still write.
 */
const DRAIN_GRACE_MS = 1000;

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

/**
 * A call's time limit: the shorter of its own (`{cmd, timeoutMs}`) and the
 * one its caller passes (the host's); the sandbox's default when neither
 * says. The same rule in every driver, so one call stops at the same time
 * whichever runs it.
 */
export function timeLimit(
	own: number | undefined,
	passed: number | undefined,
	fallback: number,
): number {
	if (own === undefined) return passed ?? fallback;
	return passed === undefined ? own : Math.min(own, passed);
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
/**
 * Git's reads, but only those a repository's own config cannot turn into a
 * program run: `status` and `ls-files` run `core.fsmonitor`, `diff`,
 * `show`, `log -p` and `blame` run external diffs and textconv filters,
 * and `log` a signature's `gpg.program`. A sandbox writes its `.git/config`
 * as freely as any file, so those count as state-changing; a caller that
 * trusts its repositories can say `mutates: false` on the call.
 */
const READ_ONLY_GIT = new Set(["rev-parse"]);

/**
 * Options that make a reading command write a file or run a program, by
 * command: `short` letters anywhere in a cluster of short options (`-uo`),
 * `long` prefixes of long options (GNU tools take any unambiguous prefix,
 * `--outp=f`). Broader than the tools' own lists on purpose: a read taken
 * for a write costs a cache miss, a write taken for a read a wrong answer.
 */
const WRITING_OPTIONS: Record<string, { short?: string; long?: string[] }> = {
	// --output, --compress-program
	sort: { short: "o", long: ["--o", "--co"] },
	// -o file; -R runs tree again with `-o 00Tree.html` in each directory
	tree: { short: "oR", long: ["--o"] },
	// --pre runs a program on every file searched
	rg: { long: ["--pre"] },
	// -C compiles a magic file into a new .mgc file
	file: { short: "C", long: ["--com"] },
};

/** Commands whose second operand is a file they write (`uniq in out`). */
const OUTPUT_OPERAND = new Set(["uniq", "xxd"]);

/**
 * Whether a shell command only reads. Deliberately narrow: a pipeline of
 * known reading commands with no redirection, command list, substitution,
 * or writing option or operand. Anything else counts as state-changing,
 * the safe side. Words are split at spaces and stripped of quotes and
 * backslashes, so `"-o"` reads as `-o`; a quoted space only makes more
 * words, which can only make a command look more like a write.
 */
export function looksReadOnly(cmd: string): boolean {
	if (/[>;&`\n\r]|\$\(|<\(/.test(cmd)) return false;
	return cmd.split("|").every((segment) => {
		const words = segment
			.trim()
			.split(/\s+/)
			.map((w) => w.replace(/['"\\]/g, ""));
		const [name = "", sub = ""] = words;
		const args = words.slice(1);
		if (name === "git" && !READ_ONLY_GIT.has(sub)) return false;
		if (name !== "git" && !READ_ONLY.has(name)) return false;
		if (
			name === "find" &&
			args.some((w) => /^-(delete|exec|execdir|ok|okdir|fprint.*|fls)$/.test(w))
		)
			return false;
		const writing = WRITING_OPTIONS[name];
		if (writing && args.some((w) => writingOption(w, writing))) return false;
		if (OUTPUT_OPERAND.has(name) && operands(args).length > 1) return false;
		return true;
	});
}

/** Whether `word` is one of the options `writing` lists. */
function writingOption(
	word: string,
	writing: { short?: string; long?: string[] },
): boolean {
	if (word.startsWith("--"))
		return (writing.long ?? []).some((prefix) => word.startsWith(prefix));
	if (!word.startsWith("-")) return false;
	return [...(writing.short ?? "")].some((letter) => word.includes(letter));
}

/**
 * A command's operands: words that are not options, `-` (stdin or stdout)
 * included, and every word after `--`. An option's own argument (`-f 1`)
 * counts as an operand too, which errs towards state-changing.
 */
function operands(args: readonly string[]): string[] {
	const end = args.indexOf("--");
	const before = end === -1 ? args : args.slice(0, end);
	const after = end === -1 ? [] : args.slice(end + 1);
	return [...before.filter((w) => w === "-" || !w.startsWith("-")), ...after];
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
	#isolation: Isolation | null = null;
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

	/** Whether commands run under bubblewrap; only once started. */
	get isolation(): Isolation {
		if (this.#isolation === null)
			throw new Error("the workspace is not started");
		return this.#isolation;
	}

	/**
	 * Decides the isolation (probing bubblewrap once per process) and
	 * creates the sandbox's empty directory under the root.
	 */
	async start(): Promise<void> {
		if (this.#stopped) throw new Error("the workspace is stopped");
		if (this.#dir !== null) return;
		const isolation = await resolveIsolation(this.#options);
		await mkdir(this.#options.root, { recursive: true });
		this.#dir = await mkdtemp(path.join(this.#options.root, "ws-"));
		this.#isolation = isolation;
	}

	/**
	 * Runs the call's command with `bash -c` in the directory: stdout and
	 * stderr through one pipe, in the order written, cut at the output cap.
	 * A timeout kills the command's process group and gives exit code 124.
	 * When the command ends, so do the processes it left, background and
	 * `setsid` jobs included: the sandbox's state is its files. One exec at
	 * a time per sandbox (the executor and the host queue them).
	 * A `cwd` that is not a directory fails the command (exit code 1), as
	 * the Docker driver's does: a failed command is a result, not an error.
	 */
	async exec(call: Call): Promise<WorkspaceExecResult> {
		const tools = this.#options.tools ?? DEFAULT_TOOLS;
		if (!tools.includes(call.tool))
			throw new TypeError(
				`the workspace driver does not run tool ${call.tool}`,
			);
		const command = commandOf(call);
		const cwd = this.#inside(command.cwd ?? ".");
		const isolated = this.isolation === "bwrap";
		// Seen from inside: under bubblewrap the sandbox is at the fixed mount.
		const home = isolated ? WORKSPACE_MOUNT : this.dir;
		const timeoutMs = command.timeoutMs ?? this.#options.timeoutMs ?? 60_000;
		const cap = this.#options.maxOutputBytes ?? 1 << 20;
		const started = performance.now();
		// The outer shell points stderr at stdout before exec'ing the
		// command's own shell: one pipe keeps the two in the order they were
		// written, which two pipes merged here could not, and the cache needs
		// the same output each time. It also moves to the call's cwd, by its
		// path relative to the sandbox: a cwd that is missing then fails the
		// command with a message that reads the same in every sandbox, where
		// spawn's own cwd would fail the exec (ENOENT).
		const shell = [
			"bash",
			"-c",
			'exec 2>&1; CDPATH= cd -- "./$2" || exit 1; exec bash -c "$1"',
			"bash",
			command.cmd,
			path.relative(this.dir, cwd) || ".",
		];
		const argv = isolated
			? [
					this.#options.bwrap ?? "bwrap",
					...(await bwrapArgs(this.#options, this.dir)),
					"--chdir",
					WORKSPACE_MOUNT,
					"--",
					...shell,
				]
			: shell;
		// Under bubblewrap the command's own stderr is already in stdout, so
		// whatever reaches stderr is bubblewrap's: kept apart, and an error.
		const child = spawn(argv[0]!, argv.slice(1), {
			cwd: this.dir,
			env: {
				PATH: process.env.PATH ?? "/usr/bin:/bin",
				HOME: home,
				LANG: "C.UTF-8",
				LC_ALL: "C.UTF-8",
				TERM: "dumb",
				...this.#options.env,
				// Last, so the caller's env cannot change it: unique to this
				// sandbox without isolation, it is how strays are found.
				TRELLIS_WORKSPACE: home,
			},
			stdio: ["ignore", "pipe", isolated ? "pipe" : "ignore"],
			detached: true,
		});
		const pgid = child.pid;
		if (pgid !== undefined) this.#running.add(pgid);
		// Piped above, so never null; the types cannot tell from a variable stdio.
		const stdout = child.stdout!;
		const drained = Promise.all(
			[stdout, child.stderr].map(
				(s) => s && new Promise((resolve) => s.once("close", resolve)),
			),
		);
		const complaints: Buffer[] = [];
		child.stderr?.on("data", (chunk: Buffer) => complaints.push(chunk));
		const chunks: Buffer[] = [];
		let kept = 0;
		let dropped = 0;
		stdout.on("data", (chunk: Buffer) => {
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
		// Jobs that left the group (setsid) go the same way, found by the
		// sandbox's variable; under bubblewrap the PID namespace ends them.
		if (!isolated) killStrays(home, pgid);
		// One that also cleared its environment escapes both and may hold
		// the pipe open for good: keep what arrives within a short grace,
		// then stop waiting and close the pipes (the job gets EPIPE).
		let grace: NodeJS.Timeout | undefined;
		const held = await Promise.race([
			drained.then(() => false),
			new Promise<boolean>((resolve) => {
				grace = setTimeout(() => resolve(true), DRAIN_GRACE_MS);
			}),
		]);
		clearTimeout(grace);
		stdout.destroy();
		child.stderr?.destroy();
		if (pgid !== undefined) this.#running.delete(pgid);
		const complaint = Buffer.concat(complaints).toString("utf8").trim();
		if (complaint !== "" && code !== 0 && !timedOut)
			// bubblewrap could not set the sandbox up, so the command never
			// ran: an output to cache would be a lie.
			throw new Error(`bubblewrap failed: ${complaint}`);
		let output = Buffer.concat(chunks).toString("utf8");
		if (dropped > 0) output += `\n[output truncated: ${dropped} more bytes]\n`;
		if (timedOut) output += `\n[timed out after ${timeoutMs} ms]\n`;
		// Said in the output, so a reader of the cached result knows it may
		// be short of what the stray process wrote later.
		if (held)
			output += `\n[output cut: a process outside the command's group held it open]\n`;
		const exitCode = timedOut
			? 124
			: (code ?? 128 + (signal ? (constants.signals[signal] ?? 0) : 0));
		return {
			output,
			exitCode,
			execMs: performance.now() - started,
			timedOut,
		};
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
		if (dir !== null && this.#isolation === "none") killStrays(dir);
		this.#dir = null;
		this.#isolation = null;
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

/**
 * Kills every process of this user whose environment says it belongs to
 * the sandbox at `dir` (`TRELLIS_WORKSPACE`, which children inherit across
 * `setsid`, `nohup` and double forks), by reading /proc; elsewhere than
 * Linux it finds none. The environment is the process's initial one, so a
 * job that replaced it (`env -i`) is not found, nor one whose environment
 * this user may not read (setuid). Each match is stopped (SIGSTOP) and
 * /proc read again until a pass finds none new, then all are killed: a
 * stray forking meanwhile leaves no child behind.
 *
 * With `since`, only pids from it up are read: Linux hands out pids in
 * increasing order, so a command's strays are there, unless the pids
 * wrapped meanwhile (the last pid handed out is then below `since`), when
 * all are read. Reading a process's environment costs about 25 µs here;
 * the range keeps an exec's sweep to the processes born since it began.
 * Written here because no package does it: tree-kill and its kin walk
 * parent links, which a daemonized job has cut.
 */
export function killStrays(dir: string, since = 0): number {
	const mark = Buffer.from(`TRELLIS_WORKSPACE=${dir}\0`);
	let from = since;
	try {
		if (Number(readFileSync("/proc/sys/kernel/ns_last_pid", "utf8")) < since)
			from = 0;
	} catch {
		from = 0;
	}
	const stopped = new Set<number>();
	for (let pass = 0; pass < 20; pass++) {
		let found = 0;
		for (const pid of marked(mark, from)) {
			if (stopped.has(pid)) continue;
			try {
				process.kill(pid, "SIGSTOP");
				stopped.add(pid);
				found++;
			} catch {
				// Gone meanwhile.
			}
		}
		if (found === 0) break;
	}
	for (const pid of stopped) {
		try {
			process.kill(pid, "SIGKILL");
		} catch {
			// Gone meanwhile.
		}
	}
	return stopped.size;
}

/** Pids from `from` up whose environment holds `mark`; none without /proc. */
function marked(mark: Buffer, from: number): number[] {
	let names: string[];
	try {
		names = readdirSync("/proc");
	} catch {
		return [];
	}
	const out: number[] = [];
	for (const name of names) {
		const pid = Number(name);
		if (!Number.isInteger(pid) || pid < from || pid === process.pid) continue;
		let environ: Buffer;
		try {
			environ = readFileSync(`/proc/${pid}/environ`);
		} catch {
			continue; // gone, or another user's
		}
		if (hasEntry(environ, mark)) out.push(pid);
	}
	return out;
}

/** Whether a NUL-separated environment holds `entry` (which ends in NUL). */
function hasEntry(environ: Buffer, entry: Buffer): boolean {
	for (
		let at = environ.indexOf(entry);
		at !== -1;
		at = environ.indexOf(entry, at + 1)
	)
		if (at === 0 || environ[at - 1] === 0) return true;
	return false;
}

function killGroup(pgid: number | undefined): void {
	if (pgid === undefined) return;
	try {
		process.kill(-pgid, "SIGKILL");
	} catch {
		// Already gone.
	}
}

/** What probing bubblewrap found: usable, or why not. */
export type BwrapProbe = { usable: true } | { usable: false; reason: string };

const probes = new Map<string, Promise<BwrapProbe>>();
const warned = new Set<string>();

/**
 * Whether bubblewrap runs here with the mounts and namespaces a sandbox
 * uses, by running `true` under it once per executable per process: it may
 * be installed and still fail where user namespaces are forbidden (some
 * containers and hardened kernels).
 */
export function probeBwrap(bwrap = "bwrap"): Promise<BwrapProbe> {
	let probe = probes.get(bwrap);
	if (!probe) {
		probe = (async (): Promise<BwrapProbe> => {
			try {
				const mounts = await bwrapArgs({ root: "/" }, null);
				await run(bwrap, [...mounts, "--", "true"], { timeout: 10_000 });
				return { usable: true };
			} catch (err) {
				const e = err as { stderr?: string; message?: string };
				const reason = (e.stderr || e.message || String(err)).trim();
				return { usable: false, reason };
			}
		})();
		probes.set(bwrap, probe);
	}
	return probe;
}

/**
 * How sandboxes with these options run their commands; see
 * {@link WorkspaceOptions.isolate}. The host can show it in its health.
 */
export async function resolveIsolation(
	options: Pick<WorkspaceOptions, "isolate" | "bwrap" | "log">,
): Promise<Isolation> {
	const mode = options.isolate ?? "none";
	if (mode === "none") return "none";
	const bwrap = options.bwrap ?? "bwrap";
	const probe = await probeBwrap(bwrap);
	if (probe.usable) return "bwrap";
	if (mode === "bwrap")
		throw new Error(`bubblewrap (${bwrap}) cannot run here: ${probe.reason}`);
	if (!warned.has(bwrap)) {
		warned.add(bwrap);
		(options.log ?? console.warn)(
			`workspace: bubblewrap (${bwrap}) cannot run here, so commands run ` +
				`without isolation: ${probe.reason}`,
		);
	}
	return "none";
}

/** bwrap's arguments for the host's top-level entries, read once. */
let topLevel: Promise<{ args: string[]; bound: Set<string> }> | null = null;

/**
 * The machine read-only, one top-level entry at a time rather than
 * `--ro-bind / /`: the fixed mount may not exist on the host, and a
 * read-only root leaves nowhere to create it. Symlinks (`/bin -> usr/bin`)
 * are recreated as symlinks. /proc, /dev and /tmp get fresh ones.
 */
function hostEntries(): Promise<{ args: string[]; bound: Set<string> }> {
	topLevel ??= (async () => {
		const skip = new Set(["proc", "dev", "tmp", WORKSPACE_MOUNT.slice(1)]);
		const args: string[] = [];
		const bound = new Set<string>();
		for (const entry of await readdir("/", { withFileTypes: true })) {
			if (skip.has(entry.name)) continue;
			const where = `/${entry.name}`;
			if (entry.isSymbolicLink())
				args.push("--symlink", await readlink(where), where);
			else {
				args.push("--ro-bind", where, where);
				bound.add(entry.name);
			}
		}
		return { args, bound };
	})();
	return topLevel;
}

/**
 * bwrap's options for a sandbox at `dir` (or, for the probe, none): every
 * namespace unshared (the network too unless asked), the host read-only,
 * the sandbox read-write at {@link WORKSPACE_MOUNT}, then the caller's
 * binds. Order matters: later mounts land on top of earlier ones.
 */
async function bwrapArgs(
	options: Pick<WorkspaceOptions, "root" | "binds" | "network">,
	dir: string | null,
): Promise<string[]> {
	const host = await hostEntries();
	const args = [
		"--unshare-all",
		...(options.network ? ["--share-net"] : []),
		// The sandbox dies with its host process; a new session keeps a
		// command from pushing keystrokes into the host's terminal.
		"--die-with-parent",
		"--new-session",
		...host.args,
		"--proc",
		"/proc",
		"--dev",
		"/dev",
		"--tmpfs",
		"/tmp",
	];
	if (dir === null) return [...args, "--tmpfs", WORKSPACE_MOUNT];
	// Sibling sandboxes would be readable through the read-only host where
	// the root is under a bound entry: cover the root with an empty tmpfs,
	// before the sandbox's bind so its mount point is made in the tmpfs.
	const root = await realpath(options.root);
	if (host.bound.has(root.split("/")[1] ?? "")) args.push("--tmpfs", root);
	args.push("--bind", dir, WORKSPACE_MOUNT);
	for (const bind of options.binds ?? []) {
		if (!path.isAbsolute(bind))
			throw new TypeError(`bind ${bind} is not an absolute path`);
		const where = path.resolve(bind);
		if (where === WORKSPACE_MOUNT || where.startsWith(WORKSPACE_MOUNT + "/"))
			throw new TypeError(`bind ${bind} is inside ${WORKSPACE_MOUNT}`);
		args.push("--bind", where, where);
	}
	return args;
}

/** A sandbox factory of workspaces under `options.root`, for the executor. */
export function workspaceFactory(options: WorkspaceOptions): SandboxFactory {
	return sandboxFactory(() => new WorkspaceSandbox(options), {
		driver: WORKSPACE_DRIVER,
	});
}
