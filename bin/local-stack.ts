/**
 * A local Trellis stack: `wrangler dev` with local D1, R2 and Durable
 * Objects persisted to a directory, migrated, with a `dev` project and a
 * trainer key and a host key ready to use. The CLI's `dev` command and the
 * Node tests both start it through {@link startLocalStack}; the CLI, the
 * demo and the end-to-end benchmark start a container host beside it with
 * {@link startLocalHost}.
 */
import { spawn, type ChildProcess } from "node:child_process";
import { randomBytes } from "node:crypto";
import { existsSync } from "node:fs";
import { mkdir, readFile, writeFile } from "node:fs/promises";
import { createServer } from "node:net";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { TrellisClient, TrellisError } from "../client/http.ts";
import type { Driver } from "../core/host-api.ts";
import { createHost, type Host } from "../host/server.ts";

/** The repository root, where `wrangler.toml` is. */
export const REPO_ROOT = path.resolve(
	path.dirname(fileURLToPath(import.meta.url)),
	"..",
);
/** Where the default stack keeps its state between runs. */
export const DEFAULT_PERSIST_DIR = path.join(REPO_ROOT, ".trellis", "state");
const WRANGLER = path.join(REPO_ROOT, "node_modules", ".bin", "wrangler");
/** The project the local stack creates its keys in. */
export const DEV_PROJECT = "dev";

/** Options of {@link startLocalStack}. */
export interface LocalStackOptions {
	/** The port to listen on (default: a free loopback port). */
	port?: number;
	/**
	 * Where D1, R2 and the Durable Objects persist (default `.trellis/state`
	 * in the repository). The default stack keeps its admin key in the
	 * repository's `.dev.vars`; any other directory gets a fresh random key
	 * passed with `--var`, so tests never touch `.dev.vars`.
	 */
	persistTo?: string;
	/** Do not echo wrangler's output (default true; it is kept for errors either way). */
	quiet?: boolean;
	/** How long to wait for `/healthz`, in ms (default 90 s). */
	startTimeoutMs?: number;
	/** Worker variables to override (`[vars]` in wrangler.toml), e.g. `WARM_FORKS`. */
	vars?: Record<string, string>;
}

/** A running local stack and the keys to use it. */
export interface LocalStack {
	/** The Worker's origin, e.g. `http://127.0.0.1:8787`. */
	url: string;
	/** The root admin key (the Worker secret `TRELLIS_ADMIN_KEY`). */
	adminKey: string;
	/** The project the keys belong to. */
	project: string;
	trainerKey: string;
	hostKey: string;
	/** The persistence directory. */
	persistTo: string;
	/** The process id of `wrangler dev` (the leader of its process group). */
	pid: number;
	/** Where wrangler's DevTools inspector listens (`bench/profile.ts` uses it). */
	inspectorPort: number;
	/** Stops `wrangler dev` and everything it started. Idempotent. */
	stop(): Promise<void>;
}

/** A port nobody listens on right now, on the loopback interface. */
export async function freePort(): Promise<number> {
	return new Promise((resolve, reject) => {
		const server = createServer();
		server.unref();
		server.on("error", reject);
		server.listen(0, "127.0.0.1", () => {
			const address = server.address();
			server.close(() =>
				typeof address === "object" && address
					? resolve(address.port)
					: reject(new Error("no port")),
			);
		});
	});
}

/** Reads `TRELLIS_ADMIN_KEY` from the repository's `.dev.vars`, adding one if missing. */
async function devVarsAdminKey(): Promise<string> {
	const file = path.join(REPO_ROOT, ".dev.vars");
	const text = existsSync(file) ? await readFile(file, "utf8") : "";
	const match = /^\s*TRELLIS_ADMIN_KEY\s*=\s*"?([^"\n]+)"?\s*$/m.exec(text);
	if (match) return match[1].trim();
	const key = `tra_${randomBytes(24).toString("hex")}`;
	const sep = text === "" || text.endsWith("\n") ? "" : "\n";
	// .dev.vars is gitignored: the key never leaves this machine.
	await writeFile(file, `${text}${sep}TRELLIS_ADMIN_KEY="${key}"\n`, {
		mode: 0o600,
	});
	return key;
}

/**
 * The stack's trainer and host keys: the ones saved beside its state when
 * they still work, so `npm start` hands out the same key every time, else
 * new ones (saved for next time).
 */
async function devKeys(
	url: string,
	admin: TrellisClient,
	persistTo: string,
): Promise<{ trainer: string; host: string }> {
	const file = path.join(persistTo, "dev-keys.json");
	try {
		const saved = JSON.parse(await readFile(file, "utf8")) as {
			trainer: string;
			host: string;
		};
		for (const key of [saved.trainer, saved.host])
			await new TrellisClient({ url, key }).listTasks({ limit: 1 });
		return saved;
	} catch (err) {
		// A missing file or a revoked key: make new ones; anything else is real.
		const stale = !(err instanceof TrellisError) || err.code === "unauthorized";
		if (!stale) throw err;
	}
	const make = async (role: "trainer" | "host") =>
		(
			await admin.createKey({
				role,
				project: DEV_PROJECT,
				name: `local-stack ${role}`,
			})
		).key;
	const keys = { trainer: await make("trainer"), host: await make("host") };
	await writeFile(file, JSON.stringify(keys), { mode: 0o600 });
	return keys;
}

/** The last lines a child printed, to explain a failed start. */
class OutputTail {
	#text = "";
	push(chunk: Buffer): void {
		this.#text = (this.#text + chunk.toString("utf8")).slice(-8000);
	}
	toString(): string {
		return this.#text;
	}
}

function wranglerEnv(): NodeJS.ProcessEnv {
	return {
		...process.env,
		// Non-interactive: no prompts (migrations ask to confirm otherwise),
		// no hotkeys panel, no telemetry or update checks over the network.
		CI: "1",
		WRANGLER_SEND_METRICS: "false",
		NO_UPDATE_NOTIFIER: "1",
		FORCE_COLOR: "0",
	};
}

/** Runs wrangler to completion; rejects with its output if it fails. */
async function wrangler(args: string[], quiet: boolean): Promise<void> {
	const tail = new OutputTail();
	const child = spawn(WRANGLER, args, {
		cwd: REPO_ROOT,
		env: wranglerEnv(),
		stdio: ["ignore", "pipe", "pipe"],
	});
	for (const stream of [child.stdout, child.stderr])
		stream.on("data", (chunk: Buffer) => {
			tail.push(chunk);
			if (!quiet) process.stderr.write(chunk);
		});
	const code = await new Promise<number | null>((resolve, reject) => {
		child.on("error", reject);
		child.on("close", resolve);
	});
	if (code !== 0)
		throw new Error(`wrangler ${args.join(" ")} exited with ${code}:\n${tail}`);
}

/** Every wrangler process group this module started and has not stopped. */
const live = new Set<number>();
// A test runner or a CLI that exits without stopping its stacks must not
// leave workerd processes behind holding ports.
process.once("exit", () => {
	for (const pgid of live) signalGroup(pgid, "SIGKILL");
});

function signalGroup(pgid: number, signal: NodeJS.Signals | 0): boolean {
	try {
		process.kill(-pgid, signal);
		return true;
	} catch {
		return false;
	}
}

/** Waits for the process group to go away, up to `ms`. */
async function groupGone(pgid: number, ms: number): Promise<boolean> {
	const deadline = Date.now() + ms;
	while (Date.now() < deadline) {
		if (!signalGroup(pgid, 0)) return true;
		await new Promise((r) => setTimeout(r, 50));
	}
	return !signalGroup(pgid, 0);
}

async function stopGroup(child: ChildProcess): Promise<void> {
	const pgid = child.pid;
	if (pgid === undefined) return;
	live.delete(pgid);
	// SIGTERM lets wrangler shut workerd down and flush local storage; a
	// group that outlives the grace period is killed outright.
	signalGroup(pgid, "SIGTERM");
	if (!(await groupGone(pgid, 5000))) {
		signalGroup(pgid, "SIGKILL");
		await groupGone(pgid, 5000);
	}
}

/**
 * Starts a local stack: applies the D1 migrations, spawns `wrangler dev` on
 * loopback, waits for `/healthz`, then makes sure project `dev` exists and
 * creates a trainer key and a host key in it.
 */
export async function startLocalStack(
	options: LocalStackOptions = {},
): Promise<LocalStack> {
	const persistTo = path.resolve(options.persistTo ?? DEFAULT_PERSIST_DIR);
	const quiet = options.quiet ?? true;
	await mkdir(persistTo, { recursive: true });
	const adminKey =
		persistTo === DEFAULT_PERSIST_DIR
			? await devVarsAdminKey()
			: `tra_${randomBytes(24).toString("hex")}`;
	await wrangler(
		["d1", "migrations", "apply", "DB", "--local", "--persist-to", persistTo],
		quiet,
	);
	// Another process can take a free port between freePort() and wrangler's
	// bind (test files start stacks in parallel): start again on new ports,
	// unless the clash is on the port the caller asked for.
	for (let attempt = 1; ; attempt++) {
		try {
			return await launch(options, persistTo, adminKey, quiet);
		} catch (err) {
			const clash = /Address already in use \(([^)]*)\)/.exec(String(err));
			const ours =
				clash !== null &&
				(options.port === undefined || !clash[1].endsWith(`:${options.port}`));
			if (!ours || attempt >= 3) throw err;
		}
	}
}

/** Spawns `wrangler dev` on free ports and readies the dev project and keys. */
async function launch(
	options: LocalStackOptions,
	persistTo: string,
	adminKey: string,
	quiet: boolean,
): Promise<LocalStack> {
	const port = options.port ?? (await freePort());
	const inspectorPort = await freePort();
	const tail = new OutputTail();
	const child = spawn(
		WRANGLER,
		[
			"dev",
			"--ip",
			"127.0.0.1",
			"--port",
			String(port),
			"--inspector-port",
			String(inspectorPort),
			"--persist-to",
			persistTo,
			"--show-interactive-dev-session=false",
			"--log-level",
			quiet ? "warn" : "info",
			// --var wins over .dev.vars (wrangler merges CLI bindings last), so
			// the stack always runs with the key we return.
			"--var",
			`TRELLIS_ADMIN_KEY:${adminKey}`,
			...Object.entries(options.vars ?? {}).flatMap(([k, v]) => [
				"--var",
				`${k}:${v}`,
			]),
		],
		{
			cwd: REPO_ROOT,
			env: wranglerEnv(),
			stdio: ["ignore", "pipe", "pipe"],
			// Its own process group, so stop() reaches workerd too.
			detached: true,
		},
	);
	if (child.pid !== undefined) live.add(child.pid);
	for (const stream of [child.stdout!, child.stderr!])
		stream.on("data", (chunk: Buffer) => {
			tail.push(chunk);
			if (!quiet) process.stderr.write(chunk);
		});
	let exited: string | null = null;
	child.on("exit", (code, signal) => {
		exited = `wrangler dev exited (${signal ?? code})`;
	});
	let stopped: Promise<void> | null = null;
	const stop = () => (stopped ??= stopGroup(child));

	const url = `http://127.0.0.1:${port}`;
	try {
		const deadline = Date.now() + (options.startTimeoutMs ?? 90_000);
		const probe = new TrellisClient({
			url,
			key: "",
			retries: 0,
			timeoutMs: 2000,
		});
		for (;;) {
			if (exited) throw new Error(`${exited}:\n${tail}`);
			if (Date.now() > deadline)
				throw new Error(
					`wrangler dev did not answer /healthz at ${url}:\n${tail}`,
				);
			try {
				await probe.health();
				break;
			} catch {
				await new Promise((r) => setTimeout(r, 200));
			}
		}
		const admin = new TrellisClient({ url, key: adminKey });
		try {
			await admin.createProject(DEV_PROJECT);
		} catch (err) {
			if (!(err instanceof TrellisError && err.code === "project_exists"))
				throw err;
		}
		const keys = await devKeys(url, admin, persistTo);
		return {
			url,
			adminKey,
			project: DEV_PROJECT,
			trainerKey: keys.trainer,
			hostKey: keys.host,
			persistTo,
			pid: child.pid!,
			inspectorPort,
			stop,
		};
	} catch (err) {
		await stop();
		throw err;
	}
}

// ------------------------------------------------------------ local host

/** The Docker image the docker driver's default template runs. */
const DOCKER_BASE_IMAGE = "trellis-base:latest";

/**
 * Whether Docker sandboxes can run here: an engine answers (what `docker
 * info` checks) and the base image is built. `why` says what is missing.
 */
export async function dockerStatus(
	image = DOCKER_BASE_IMAGE,
): Promise<{ ok: true } | { ok: false; why: string }> {
	let engine;
	try {
		// Imported lazily: only the docker check needs the engine client.
		const { DockerEngine } = await import("../host/drivers/docker.ts");
		engine = new DockerEngine();
	} catch (err) {
		return { ok: false, why: `the docker driver did not load: ${err}` };
	}
	if (!(await engine.ping()))
		return { ok: false, why: "no Docker engine answers" };
	try {
		await engine.inspectImage(image);
		return { ok: true };
	} catch {
		return {
			ok: false,
			why: `the engine has no ${image} (build it with host/images/build.sh)`,
		};
	}
}

/** Options of {@link startLocalHost}. */
export interface LocalHostOptions {
	/** The Worker's origin. */
	worker: string;
	/** A `host` key of the project the host serves. */
	key: string;
	/**
	 * The drivers to offer (default workspace and sqlite, and docker when
	 * {@link dockerStatus} says it can run).
	 */
	drivers?: readonly Driver[];
	/** Sandboxes at once (default 32: a GRPO group of 8 with warm pools fits twice). */
	capacity?: number;
	/** A name shown in the Worker's host list (default `local`). */
	name?: string;
	/** Where the host logs (default: nowhere). */
	log?: (message: string) => void;
}

/** A container host started beside a local stack. */
export interface LocalHost {
	host: Host;
	url: string;
	id: string;
	/** The drivers the host offers. */
	drivers: readonly Driver[];
	/** Why docker is not among them, when it is not (null when it is, or was not asked for). */
	dockerMissing: string | null;
}

/**
 * Starts a container host on loopback and registers it with the Worker.
 * Its sandboxes live in a temporary directory removed by `host.stop()`.
 */
export async function startLocalHost(
	options: LocalHostOptions,
): Promise<LocalHost> {
	let drivers = options.drivers;
	let dockerMissing: string | null = null;
	if (!drivers) {
		const docker = await dockerStatus();
		dockerMissing = docker.ok ? null : docker.why;
		drivers = docker.ok
			? ["workspace", "sqlite", "docker"]
			: ["workspace", "sqlite"];
	}
	const host = createHost({
		worker: options.worker,
		key: options.key,
		name: options.name ?? "local",
		capacity: options.capacity ?? 32,
		drivers,
		log: options.log ?? (() => undefined),
	});
	const { url, id } = await host.start();
	return { host, url, id, drivers: host.drivers, dockerMissing };
}
