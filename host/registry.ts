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
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import type { Driver, Template } from "../core/host-api.ts";
import {
	sandboxFactory,
	type Call,
	type SandboxFactory,
} from "../client/sandbox.ts";
import { WorkspaceSandbox, workspaceFactory } from "./drivers/workspace.ts";

const run = promisify(execFile);

/** The repository root (this file lives in `host/`). */
export const REPO_ROOT = path.resolve(
	path.dirname(fileURLToPath(import.meta.url)),
	"..",
);

/** The Docker image a template without a name starts. */
export const DEFAULT_IMAGE = "trellis-base:latest";

/** The SQLite databases every host knows, by template name. */
export const DEFAULT_DATABASES: Readonly<Record<string, string>> = {
	chinook: path.resolve(REPO_ROOT, "..", "shared", "data", "chinook.sqlite"),
};

/** What the host was configured with, per driver. */
export interface DriverConfig {
	/** A directory the drivers keep their sandboxes under (one subdirectory each). */
	dataDir: string;
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
	};
	docker?: {
		/** Template name → image; a name not listed is taken as an image itself. */
		images?: Record<string, string>;
		/** The image of a template without a name (default {@link DEFAULT_IMAGE}). */
		defaultImage?: string;
	};
	sqlite?: {
		/** Template name → database file, on top of {@link DEFAULT_DATABASES}. */
		databases?: Record<string, string>;
	};
}

/** Per-call limits the server passes a driver. */
export interface ExecLimits {
	timeoutMs: number;
	maxOutputBytes: number;
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
	 * The call as this driver should run it under `limits`, for drivers that
	 * take a time limit in the call itself. Without it the server enforces
	 * the time limit from outside, by stopping a sandbox that overruns.
	 */
	limit?(call: Call, limits: ExecLimits): Call;
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
	};
	const empty = workspaceFactory(options);
	const seeds = config.workspace?.seeds ?? {};
	const seeded = new Map<string, SandboxFactory>();
	return {
		name: "workspace",
		factory(template) {
			if (template.name === undefined) return empty;
			const seed = seeds[template.name];
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
		// The workspace reads a time limit from the call's own args; the
		// request's limit caps whatever the agent asked for.
		limit(call, limits) {
			const args = call.args;
			if (typeof args === "string")
				return { ...call, args: { cmd: args, timeoutMs: limits.timeoutMs } };
			if (args !== null && typeof args === "object" && !Array.isArray(args)) {
				const own = (args as Record<string, unknown>).timeoutMs;
				const timeoutMs =
					typeof own === "number"
						? Math.min(own, limits.timeoutMs)
						: limits.timeoutMs;
				return { ...call, args: { ...args, timeoutMs } };
			}
			return call;
		},
	};
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
 * Imports a driver module that may not exist yet or whose dependencies may
 * be missing on this machine. The specifier is a variable so that the
 * type-checker does not require the file.
 */
async function importDriver(file: string): Promise<Record<string, unknown>> {
	const url = new URL(`./drivers/${file}`, import.meta.url);
	if (!existsSync(fileURLToPath(url)))
		throw new DriverUnavailableError(`host/drivers/${file} does not exist`);
	try {
		return (await import(url.href)) as Record<string, unknown>;
	} catch (err) {
		throw new DriverUnavailableError(
			`host/drivers/${file} did not load: ${(err as Error).message}`,
		);
	}
}

const loadDocker: DriverLoader = async (config) => {
	try {
		await run("docker", ["info", "--format", "{{.ServerVersion}}"], {
			timeout: 10_000,
		});
	} catch (err) {
		throw new DriverUnavailableError(
			`docker info failed: ${(err as Error).message.split("\n")[0]}`,
		);
	}
	const mod = await importDriver("docker.ts");
	const make = mod.dockerFactory;
	if (typeof make !== "function")
		throw new DriverUnavailableError(
			"host/drivers/docker.ts exports no dockerFactory",
		);
	const images = config.docker?.images ?? {};
	const factories = new Map<string, SandboxFactory>();
	return {
		name: "docker",
		factory(template) {
			const image =
				template.name === undefined
					? (config.docker?.defaultImage ?? DEFAULT_IMAGE)
					: (images[template.name] ?? template.name);
			const key = `${image}\n${template.network === true}`;
			let factory = factories.get(key);
			if (!factory) {
				factory = (make as (o: unknown) => SandboxFactory)({
					image,
					network: template.network === true,
					timeoutMs: config.execTimeoutMs,
					maxOutputBytes: config.maxOutputBytes,
				});
				factories.set(key, factory);
			}
			return factory;
		},
	};
};

const loadSqlite: DriverLoader = async (config) => {
	const mod = await importDriver("sqlite.ts");
	const make = mod.sqliteFactory;
	if (typeof make !== "function")
		throw new DriverUnavailableError(
			"host/drivers/sqlite.ts exports no sqliteFactory",
		);
	const databases = {
		...DEFAULT_DATABASES,
		...config.sqlite?.databases,
	};
	const factories = new Map<string, SandboxFactory>();
	return {
		name: "sqlite",
		factory(template) {
			const name = template.name ?? "chinook";
			const file = databases[name];
			if (file === undefined || !existsSync(file))
				throw new UnknownTemplateError(`no sqlite database named ${name}`);
			let factory = factories.get(name);
			if (!factory) {
				factory = (make as (o: unknown) => SandboxFactory)({
					root: path.join(config.dataDir, "sqlite"),
					database: file,
					maxOutputBytes: config.maxOutputBytes,
				});
				factories.set(name, factory);
			}
			return factory;
		},
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
