/**
 * The container host's drivers, by name. Each driver module (a directory
 * workspace, Docker, SQLite) plugs in here through a {@link DriverLoader}
 * that either returns a {@link HostDriver} or says why the driver cannot run
 * on this machine; the server only ever sees the drivers that loaded.
 *
 * A driver module knows nothing of templates or HTTP: it exports a
 * {@link SandboxFactory} maker. This file turns a {@link Template}
 * (`{driver, name}` from the Worker) into the factory for it, using what the
 * host was configured with: seed directories for workspaces, images for
 * Docker, database files for SQLite.
 */
import { execFile } from "node:child_process";
import { existsSync } from "node:fs";
import path from "node:path";
import { promisify } from "node:util";
import type { Driver, Template } from "../core/host-api.ts";
import {
	sandboxFactory,
	type Call,
	type ExecResult,
	type Sandbox,
	type SandboxFactory,
} from "../client/sandbox.ts";
import {
	WorkspaceSandbox,
	timeLimit,
	workspaceFactory,
} from "./drivers/workspace.ts";

const run = promisify(execFile);

/** The label on every container and image a host's Docker sandboxes make. */
export const HOST_LABEL = "trellis.host";

/** What the host was configured with, per driver. */
export interface DriverConfig {
	/** A directory the drivers keep their sandboxes under (one subdirectory each). */
	dataDir: string;
	/**
	 * Unique to this host process: drivers label what they create outside
	 * `dataDir` (containers, images) with it, to remove what a stop left.
	 */
	instance: string;
	/**
	 * The largest output a driver should keep for one call, in bytes. The
	 * server cuts each call's output to what its request asks; this is the
	 * ceiling drivers buffer up to.
	 */
	maxOutputBytes: number;
	/** A command's time limit when neither the request nor the call gives one. */
	execTimeoutMs: number;
	workspace?: {
		/** Template name → a directory copied into each new workspace. */
		seeds?: Record<string, string>;
		/**
		 * Isolate commands with bubblewrap: `auto` (the default) when `bwrap`
		 * works here, else plain bash; `none` only for trusted workloads.
		 */
		isolate?: "auto" | "bwrap" | "none";
		/** Paths outside the sandbox an isolated command may write. */
		binds?: readonly string[];
	};
	docker?: {
		/** Template name → image; a name not listed is taken as an image itself. */
		images?: Record<string, string>;
		/** The image of a template without a name (default the driver's, `trellis-base:latest`). */
		defaultImage?: string;
	};
	sqlite?: {
		/** Template name → database file, on top of the driver's (`chinook`). */
		databases?: Record<string, string>;
	};
}

/** Per-call limits the server passes a driver. */
export interface ExecLimits {
	timeoutMs: number;
	maxOutputBytes: number;
}

/** What a call gave, as the host answers it. */
export interface HostExecResult extends ExecResult {
	timedOut: boolean;
}

/** A driver as the server uses it. */
export interface HostDriver {
	readonly name: Driver;
	/**
	 * The factory of a template's sandboxes. Throws
	 * {@link UnknownTemplateError} for a name this host was not configured
	 * with.
	 */
	factory(template: Template): SandboxFactory;
	/**
	 * Runs a call in one of this driver's sandboxes under `limits`: at most
	 * `timeoutMs` (a timed-out command exits 124 and the sandbox lives on)
	 * and `maxOutputBytes` of output, with a marker saying what was cut.
	 */
	exec(
		sandbox: Sandbox,
		call: Call,
		limits: ExecLimits,
	): Promise<HostExecResult>;
	/** Releases what the driver holds (connections, caches). */
	stop?(): Promise<void>;
}

/** A template name the host was not configured with. */
export class UnknownTemplateError extends Error {
	override readonly name = "UnknownTemplateError";
}

/** A driver that cannot run here, with the reason (logged, shown in the CLI). */
export class DriverUnavailableError extends Error {
	override readonly name = "DriverUnavailableError";
}

/** Loads one driver; throws {@link DriverUnavailableError} when it cannot run here. */
export type DriverLoader = (config: DriverConfig) => Promise<HostDriver>;

// ------------------------------------------------------------ workspace

function workspaceDriver(config: DriverConfig): HostDriver {
	const options = {
		root: path.join(config.dataDir, "workspace"),
		timeoutMs: config.execTimeoutMs,
		maxOutputBytes: config.maxOutputBytes,
		isolate: config.workspace?.isolate ?? "auto",
		binds: config.workspace?.binds,
	};
	const empty = workspaceFactory(options);
	const seeds = config.workspace?.seeds ?? {};
	const seeded = new Map<string, SandboxFactory>();
	return {
		name: "workspace",
		factory(template) {
			if (template.name === undefined) return empty;
			const seed = configured(seeds, template.name);
			if (seed === undefined)
				throw new UnknownTemplateError(
					`no workspace seed named ${template.name}`,
				);
			let factory = seeded.get(template.name);
			if (!factory) {
				factory = seededWorkspaces(options, seed);
				seeded.set(template.name, factory);
			}
			return factory;
		},
		// The workspace takes a time limit only in the call's own args and
		// an output cap only when constructed: the request's time limit caps
		// what the agent asked for, and the output is cut here.
		async exec(sandbox, call, limits) {
			const r = await (sandbox as WorkspaceSandbox).exec(
				withTimeout(call, limits.timeoutMs),
			);
			return {
				output: capOutput(r.output, limits.maxOutputBytes),
				exitCode: r.exitCode,
				execMs: r.execMs,
				// The call's own limit may be the shorter one, so only the
				// driver knows whether a limit stopped it.
				timedOut: r.timedOut,
			};
		},
	};
}

/**
 * A workspace call with its time limit at most `timeoutMs`, the rule every
 * driver keeps ({@link timeLimit}). A `timeoutMs` that is not a number is
 * left for the driver to refuse.
 */
function withTimeout(call: Call, timeoutMs: number): Call {
	const args = call.args;
	if (typeof args === "string")
		return { ...call, args: { cmd: args, timeoutMs } };
	if (args !== null && typeof args === "object" && !Array.isArray(args)) {
		const own = (args as Record<string, unknown>).timeoutMs;
		if (own !== undefined && typeof own !== "number") return call;
		const limit = timeLimit(own, timeoutMs, timeoutMs);
		return { ...call, args: { ...args, timeoutMs: limit } };
	}
	return call;
}

/**
 * A configured value by template name, only if configured: a name such as
 * `constructor` or `__proto__` must not find what every object inherits.
 */
function configured<T>(
	table: Readonly<Record<string, T>>,
	name: string,
): T | undefined {
	return Object.hasOwn(table, name) ? table[name] : undefined;
}

/**
 * Cuts output to `cap` UTF-8 bytes at a character boundary, saying how much
 * was dropped, the way the drivers mark their own cut.
 */
export function capOutput(output: string, cap: number): string {
	const bytes = Buffer.from(output, "utf8");
	if (bytes.length <= cap) return output;
	let end = cap;
	// Back off continuation bytes so no character is split in two.
	while (end > 0 && (bytes[end] & 0xc0) === 0x80) end--;
	const dropped = bytes.length - end;
	return `${bytes.subarray(0, end).toString("utf8")}\n[output truncated: ${dropped} more bytes]\n`;
}

/** Workspaces that start as a copy of `seed`. */
function seededWorkspaces(
	options: ConstructorParameters<typeof WorkspaceSandbox>[0],
	seed: string,
): SandboxFactory {
	const base = sandboxFactory(() => new WorkspaceSandbox(options));
	return {
		...base,
		async start() {
			const sandbox = new WorkspaceSandbox(options);
			await sandbox.start();
			try {
				await run("cp", ["-a", "--reflink=auto", `${seed}/.`, sandbox.dir]);
			} catch (err) {
				await sandbox.stop();
				throw err;
			}
			return sandbox;
		},
	};
}

const loadWorkspace: DriverLoader = async (config) => workspaceDriver(config);

// ------------------------------------------------------ docker and sqlite

/**
 * Imports a driver module whose dependencies may be missing on this
 * machine; a failure makes the driver unavailable, not the host.
 */
async function importDriver<T>(
	file: string,
	load: () => Promise<T>,
): Promise<T> {
	try {
		return await load();
	} catch (err) {
		throw new DriverUnavailableError(
			`host/drivers/${file} did not load: ${(err as Error).message}`,
		);
	}
}

/** A sandbox whose driver takes per-call limits as `exec`'s second argument. */
interface LimitedSandbox {
	exec(
		call: Call,
		limits: Partial<ExecLimits>,
	): Promise<ExecResult & { timedOut?: boolean }>;
}

/** Docker and SQLite sandboxes honor the limits themselves. */
async function execWithLimits(
	sandbox: Sandbox,
	call: Call,
	limits: ExecLimits,
): Promise<HostExecResult> {
	const r = await (sandbox as unknown as LimitedSandbox).exec(call, limits);
	return {
		output: r.output,
		exitCode: r.exitCode,
		execMs: r.execMs,
		timedOut:
			r.timedOut ?? (r.exitCode === 124 && r.execMs >= limits.timeoutMs),
	};
}

const loadDocker: DriverLoader = async (config) => {
	const docker = await importDriver(
		"docker.ts",
		() => import("./drivers/docker.ts"),
	);
	// What `docker info` checks, without needing the docker CLI: the
	// engine answers on the socket the driver will use.
	if (!(await new docker.DockerEngine().ping()))
		throw new DriverUnavailableError("no Docker engine answers on its socket");
	const images = config.docker?.images ?? {};
	// One creation limit for every template: the engine saturates as a whole.
	const limiter = new docker.CreationLimiter();
	const factories = new Map<string, SandboxFactory>();
	return {
		name: "docker",
		factory(template) {
			const image =
				template.name === undefined
					? (config.docker?.defaultImage ?? docker.DEFAULT_IMAGE)
					: (configured(images, template.name) ?? template.name);
			const network = template.network === true;
			const key = `${image}\n${network}`;
			let factory = factories.get(key);
			if (!factory) {
				factory = docker.dockerFactory({
					image,
					network,
					limiter,
					labels: { [HOST_LABEL]: config.instance },
					timeoutMs: config.execTimeoutMs,
					maxOutputBytes: config.maxOutputBytes,
				});
				factories.set(key, factory);
			}
			return factory;
		},
		exec: execWithLimits,
		// Sandboxes are stopped one by one first; this catches what a
		// failed stop or an interrupted fork left behind.
		async stop() {
			await docker.removeLabelled({ [HOST_LABEL]: config.instance });
		},
	};
};

const loadSqlite: DriverLoader = async (config) => {
	const sqlite = await importDriver(
		"sqlite.ts",
		() => import("./drivers/sqlite.ts"),
	);
	const databases = { ...sqlite.SQLITE_SEEDS, ...config.sqlite?.databases };
	const factories = new Map<string, SandboxFactory>();
	return {
		name: "sqlite",
		factory(template) {
			const name = template.name ?? "chinook";
			const seed = configured(databases, name);
			if (seed === undefined || !existsSync(seed))
				throw new UnknownTemplateError(`no sqlite database named ${name}`);
			let factory = factories.get(name);
			if (!factory) {
				factory = sqlite.sqliteFactory({
					root: path.join(config.dataDir, "sqlite"),
					seed,
					timeoutMs: config.execTimeoutMs,
					maxOutputBytes: config.maxOutputBytes,
				});
				factories.set(name, factory);
			}
			return factory;
		},
		exec: execWithLimits,
	};
};

/** Every driver this file knows how to load, by name. */
export const LOADERS: Readonly<Record<Driver, DriverLoader>> = {
	workspace: loadWorkspace,
	docker: loadDocker,
	sqlite: loadSqlite,
};

/** What {@link loadDrivers} found. */
export interface LoadedDrivers {
	drivers: Map<Driver, HostDriver>;
	/** Drivers asked for that cannot run here, with the reason. */
	unavailable: Map<Driver, string>;
}

/**
 * Loads the drivers named (default: all), keeping those that can run here.
 * `workspace` always can. A loader passed in `extra` replaces the built-in
 * one of its name (tests, embedders with their own driver).
 */
export async function loadDrivers(
	config: DriverConfig,
	names: readonly Driver[] = Object.keys(LOADERS) as Driver[],
	extra: Partial<Record<Driver, DriverLoader>> = {},
): Promise<LoadedDrivers> {
	const drivers = new Map<Driver, HostDriver>();
	const unavailable = new Map<Driver, string>();
	for (const name of names) {
		const loader = extra[name] ?? LOADERS[name];
		try {
			drivers.set(name, await loader(config));
		} catch (err) {
			if (!(err instanceof DriverUnavailableError)) throw err;
			unavailable.set(name, err.message);
		}
	}
	return { drivers, unavailable };
}
