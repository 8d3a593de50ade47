/**
 * The Docker sandbox driver: a sandbox is a container of a locally built
 * image (`host/images/build.sh` makes `trellis-base:latest`), and a call is
 * a `/bin/sh` command run in it with `docker exec`. Its state is the
 * container's filesystem plus the shell's working directory and exported
 * variables, which the driver carries from one exec to the next the way a
 * terminal would.
 *
 * It talks to the Docker Engine API (pinned to v1.41, Docker 20.10) over the
 * engine's unix socket with `node:http`: the handful of endpoints it needs
 * are plain HTTP, and the one framing the API adds (the 8-byte headers of a
 * multiplexed exec stream) is a dozen lines. That keeps the host free of a
 * client library and of its dependency tree.
 *
 * - fork: `docker commit` with `pause=false`, then a container from the new
 *   image. The source keeps running: a commit of a busy container may catch
 *   a file half-written by a command still running, which an exec-at-a-time
 *   caller never sees, and it is what TVCache's fork does.
 * - snapshot: commit, then `docker save` of that image by id, gzipped, with
 *   the template image's layers left out: a snapshot holds what commands
 *   changed (kilobytes, not the 2 MB busybox or 300 MB Debian base), and
 *   `docker load` restores it on any engine that has the same template
 *   image. `thinSnapshots: false` makes self-contained archives.
 * - The image must have `/bin/sh`, `env`, `setsid`, `cat`, `mv`, `mkdir`,
 *   `sleep` and `kill` (busybox or a Debian base has them).
 * - Everything the driver creates carries the label `trellis=1` (and the
 *   factory's own labels), so leftovers can be found and removed
 *   ({@link removeLabelled}).
 *
 * Processes are not state: a command's background jobs are killed when it
 * returns, as in the workspace driver, and a fork or a snapshot holds files,
 * the working directory and the environment, never running programs.
 */
import { randomBytes } from "node:crypto";
import http from "node:http";
import path from "node:path";
import { Readable } from "node:stream";
import { promisify } from "node:util";
import { createGunzip, gzip as gzipCallback } from "node:zlib";
import type {
	Call,
	ExecResult,
	Sandbox,
	SandboxFactory,
	SnapshotSource,
} from "../../client/sandbox.ts";
import { commandOf, defaultMutates, timeLimit } from "./workspace.ts";

const gzip = promisify(gzipCallback);

/** The driver name recorded in snapshot refs. */
export const DOCKER_DRIVER = "docker";

/** The image `host/images/build.sh` builds; the default template. */
export const DEFAULT_IMAGE = "trellis-base:latest";

/** The label on every container and image the driver creates. */
export const TRELLIS_LABEL = "trellis";

const API = "/v1.41";
const DEFAULT_TOOLS = ["bash", "sh", "shell"] as const;
/** Repository of the images that back forked and restored sandboxes. */
const SANDBOX_REPO = "trellis-sandbox";
/** Repository of the short-lived images a snapshot commits and saves. */
const SNAPSHOT_REPO = "trellis-snapshot";
/**
 * overlay2 refuses images deeper than 125 layers, and every fork adds one:
 * past this depth a fork flattens the filesystem into a single layer.
 */
const DEFAULT_MAX_LAYERS = 100;

/** Options of a {@link DockerSandbox} and a {@link DockerSandboxFactory}. */
export interface DockerOptions {
	/** The image fresh sandboxes start from (default {@link DEFAULT_IMAGE}). */
	image?: string;
	/**
	 * Whether containers get the default bridge network (default `false`:
	 * `--network none`, tools run offline unless the template asks).
	 */
	network?: boolean;
	/** The engine's socket (default `$DOCKER_HOST` if `unix://`, else `/var/run/docker.sock`). */
	socketPath?: string;
	/** Where the first command runs and `cwd` is relative to (default `/work`). */
	workdir?: string;
	/** Environment variables of every container, on top of the image's. */
	env?: Record<string, string>;
	/**
	 * A command's time limit in ms (default 60 s) when the call gives none;
	 * a limit passed to `exec` caps the call's ({@link timeLimit}).
	 */
	timeoutMs?: number;
	/** Output kept per call, in bytes (default 1 MiB); the rest is cut off. */
	maxOutputBytes?: number;
	/** Tool names run as shell commands (default `bash`, `sh`, `shell`). */
	tools?: readonly string[];
	/** Whether a call changes state, when the caller does not say (default the workspace driver's {@link defaultMutates}). */
	mutates?: (call: Call) => boolean;
	/** Labels added to every container and image, e.g. to tell hosts apart. */
	labels?: Record<string, string>;
	/**
	 * Containers created at once (default 4). TVCache (appendix E) found that
	 * unlimited concurrent creation saturates the engine and times out.
	 * Ignored when {@link limiter} is given.
	 */
	maxConcurrentCreates?: number;
	/** A limiter shared with other factories on the same engine. */
	limiter?: CreationLimiter;
	/** Image depth past which a fork flattens (default 100; overlay2 stops at 125). */
	maxLayers?: number;
	/** Whether snapshots are gzipped (default `true`; `docker load` takes both). */
	compress?: boolean;
	/**
	 * Whether snapshots leave out the layers they share with {@link image}
	 * (default `true`): a snapshot then holds only what the commands
	 * changed, and restores on any host that has the same template image
	 * (`host/images/build.sh` builds the same base layer from the same
	 * busybox). `false` makes self-contained archives.
	 */
	thinSnapshots?: boolean;
	/** Extra `HostConfig` of every container (memory, CPUs, ...), merged last. */
	hostConfig?: Record<string, unknown>;
}

/** Per-exec overrides, as the host protocol's exec request carries them. */
export interface DockerExecOptions {
	timeoutMs?: number;
	maxOutputBytes?: number;
}

/** What an exec gave, with what the host protocol reports besides. */
export interface DockerExecResult extends ExecResult {
	timedOut: boolean;
	/** Bytes cut off at the output cap. */
	droppedBytes: number;
}

// ---------------------------------------------------------------- engine

/** An error answer of the Docker Engine API. */
export class DockerError extends Error {
	constructor(
		readonly status: number,
		message: string,
	) {
		super(`docker: ${message} (${status})`);
	}
}

type Query = Record<string, string | number | boolean | string[] | undefined>;

interface RequestOptions {
	query?: Query;
	/** A JSON value, or raw bytes / a stream sent as `contentType`. */
	body?: unknown;
	contentType?: string;
	signal?: AbortSignal;
}

/**
 * A minimal Docker Engine API client over the unix socket: JSON requests
 * and streamed bodies. Exported for the host (to tell whether an engine is
 * reachable) and for tests that look at containers directly.
 */
export class DockerEngine {
	readonly socketPath: string;
	readonly #agent: http.Agent;

	constructor(socketPath?: string) {
		this.socketPath = socketPath ?? defaultSocketPath();
		// Keep-alive saves a connect per call; exec streams are hijacked by
		// the engine and closed after, which the agent copes with.
		this.#agent = new http.Agent({ keepAlive: true, maxSockets: 64 });
	}

	/** Whether the engine answers `/_ping`. */
	async ping(): Promise<boolean> {
		try {
			const res = await this.request("GET", "/_ping");
			res.resume();
			return res.statusCode === 200;
		} catch {
			return false;
		}
	}

	/** Sends a request; resolves with the response, whatever its status. */
	request(
		method: string,
		path: string,
		options: RequestOptions = {},
	): Promise<http.IncomingMessage> {
		const { body, query, contentType, signal } = options;
		let payload: Buffer | Readable | undefined;
		let type = contentType;
		if (body instanceof Readable) payload = body;
		else if (body instanceof Uint8Array)
			payload = Buffer.from(body.buffer, body.byteOffset, body.byteLength);
		else if (body !== undefined) {
			payload = Buffer.from(JSON.stringify(body));
			type = "application/json";
		}
		return new Promise((resolve, reject) => {
			const req = http.request({
				socketPath: this.socketPath,
				agent: this.#agent,
				method,
				path: API + path + queryString(query),
				headers: {
					...(type ? { "content-type": type } : {}),
					...(Buffer.isBuffer(payload)
						? { "content-length": payload.length }
						: {}),
				},
				signal,
			});
			req.on("response", resolve);
			req.on("error", reject);
			if (payload instanceof Readable) {
				payload.on("error", (err) => req.destroy(err));
				payload.pipe(req);
			} else req.end(payload);
		});
	}

	/** A request whose answer is JSON (or empty); throws a {@link DockerError} on 4xx/5xx. */
	async json<T = unknown>(
		method: string,
		path: string,
		options: RequestOptions = {},
	): Promise<T> {
		const res = await this.request(method, path, options);
		const text = (await readAll(res)).toString("utf8");
		if ((res.statusCode ?? 500) >= 400) throw errorOf(res.statusCode, text);
		return (text === "" ? undefined : JSON.parse(text)) as T;
	}

	/** `GET /containers/{id}/json`. */
	inspectContainer(id: string): Promise<ContainerInfo> {
		return this.json("GET", `/containers/${enc(id)}/json`);
	}

	/** `GET /images/{name}/json`. */
	inspectImage(name: string): Promise<ImageInfo> {
		return this.json("GET", `/images/${enc(name)}/json`);
	}

	/** Removes a container and its anonymous volumes; gone already is fine. */
	async removeContainer(id: string): Promise<void> {
		try {
			await this.json("DELETE", `/containers/${enc(id)}`, {
				query: { force: true, v: true },
			});
		} catch (err) {
			if (!(err instanceof DockerError && err.status === 404)) throw err;
		}
	}

	/**
	 * Removes an image reference. Not forced: a tag whose image still backs a
	 * container stays (409), and an image with child images is only untagged
	 * and pruned with its last child, so nothing in use is ever pulled out.
	 */
	async removeImage(name: string): Promise<boolean> {
		try {
			await this.json("DELETE", `/images/${enc(name)}`);
			return true;
		} catch (err) {
			if (err instanceof DockerError && err.status === 404) return true;
			if (err instanceof DockerError && err.status === 409) return false;
			// Two sandboxes restored from one archive share its image id; when
			// both stop at once, the engine answers the loser of the race with
			// a 500 instead of a 404. The image is gone either way.
			if (
				err instanceof DockerError &&
				err.status === 500 &&
				/unrecognized image ID|no such image/i.test(err.message)
			)
				return true;
			throw err;
		}
	}
}

/** The parts of `docker inspect` of a container the driver reads. */
export interface ContainerInfo {
	Id: string;
	Image: string;
	State: { Running: boolean; Paused: boolean; Status: string };
	Config: { Labels: Record<string, string> | null };
}

/** The parts of `docker image inspect` the driver reads. */
export interface ImageInfo {
	Id: string;
	RepoTags: string[] | null;
	RootFS: { Layers?: string[] };
	Config: { Labels: Record<string, string> | null } | null;
}

function defaultSocketPath(): string {
	const host = process.env.DOCKER_HOST;
	if (host?.startsWith("unix://")) return host.slice("unix://".length);
	return "/var/run/docker.sock";
}

function queryString(query: Query | undefined): string {
	if (!query) return "";
	const params = new URLSearchParams();
	for (const [key, value] of Object.entries(query)) {
		if (value === undefined) continue;
		if (Array.isArray(value)) for (const v of value) params.append(key, v);
		else params.append(key, String(value));
	}
	const s = params.toString();
	return s === "" ? "" : `?${s}`;
}

function enc(s: string): string {
	return encodeURIComponent(s);
}

async function readAll(stream: Readable): Promise<Buffer> {
	const chunks: Buffer[] = [];
	for await (const chunk of stream) chunks.push(chunk as Buffer);
	return Buffer.concat(chunks);
}

function errorOf(status: number | undefined, text: string): DockerError {
	let message = text.trim();
	try {
		message = (JSON.parse(text) as { message?: string }).message ?? message;
	} catch {
		// Not JSON: keep the text.
	}
	return new DockerError(status ?? 500, message);
}

// ---------------------------------------------------------------- limiter

/**
 * A counting semaphore over container creation, with counters a test or
 * the host's health report can read. Share one between factories that use
 * the same engine.
 */
export class CreationLimiter {
	readonly limit: number;
	/** Creations running now. */
	active = 0;
	/** The most that ever ran at once. */
	maxActive = 0;
	/** Creations finished (successfully or not). */
	total = 0;
	#waiting: (() => void)[] = [];

	constructor(limit = 4) {
		if (!Number.isInteger(limit) || limit < 1)
			throw new RangeError("the creation limit must be a positive integer");
		this.limit = limit;
	}

	/** Runs `fn` once fewer than `limit` others are running. */
	async run<T>(fn: () => Promise<T>): Promise<T> {
		if (this.active >= this.limit)
			await new Promise<void>((resolve) => this.#waiting.push(resolve));
		else this.active++;
		this.maxActive = Math.max(this.maxActive, this.active);
		try {
			return await fn();
		} finally {
			this.total++;
			// Hand the slot straight to the next waiter, so a burst of new
			// callers cannot overtake it between release and wake-up.
			const next = this.#waiting.shift();
			if (next) next();
			else this.active--;
		}
	}
}

// ---------------------------------------------------------------- shell

/** Where a container keeps the shell state carried between execs. */
const STATE = "/.trellis";

/**
 * Run once in a new container: records the starting directory and the
 * container's environment as the state the first command starts from.
 * Forked and restored containers have the state already and keep it.
 */
const INIT = `[ -d ${STATE} ] && exit 0
mkdir -p ${STATE} || exit 1
printf '%s\\n' "$1" >${STATE}/workdir
cd "$1" 2>/dev/null || cd /
pwd >${STATE}/cwd
export -p >${STATE}/env`;

/**
 * The command's own shell ($1 the directory given by the call or empty, $2
 * the command). It starts from an empty environment (`env -i` in OUTER)
 * and sources the saved one, so variables the last command unset stay
 * unset; it `eval`s the command in this shell, so `cd` and `export` take
 * effect here; and it saves `pwd` and `export -p` when it ends, by falling
 * off the end or by `exit`. State files are replaced by rename, so a
 * command killed while saving leaves the previous state whole. Paths are
 * literal because the command may change any variable.
 */
const INNER = `[ -r ${STATE}/env ] && . ${STATE}/env
cd "$(cat ${STATE}/cwd 2>/dev/null)" 2>/dev/null ||
	cd "$(cat ${STATE}/workdir 2>/dev/null)" 2>/dev/null || cd /
if [ -n "$1" ]; then
	cd "$(cat ${STATE}/workdir 2>/dev/null)" 2>/dev/null
	cd "$1" || exit 1
fi
__trellis_save() {
	{ pwd >${STATE}/cwd.new && export -p >${STATE}/env.new &&
		mv -f ${STATE}/env.new ${STATE}/env &&
		mv -f ${STATE}/cwd.new ${STATE}/cwd; } 2>/dev/null
}
trap '__trellis_rc=$?; __trellis_save; exit $__trellis_rc' EXIT
eval "$2"
__trellis_rc=$?
trap - EXIT
__trellis_save
exit $__trellis_rc`;

/**
 * What `docker exec` runs ($1 a token naming this exec, $2 INNER, $3 and
 * $4 INNER's arguments). stderr joins stdout here, in one pipe, so the two
 * stay in the order written. The command runs in its own session (setsid)
 * so that a timeout, and the cleanup after it returns, can kill its whole
 * process group, background jobs included: those would otherwise hold the
 * exec's output open. The group id goes to a file the timeout reads.
 */
const OUTER = `exec 2>&1
setsid env -i /bin/sh -c "$2" sh "$3" "$4" </dev/null &
__j=$!
echo $__j >${STATE}/job.$1
# The shell reports a killed job ("Killed") on stderr: not the command's.
wait $__j 2>/dev/null
__rc=$?
kill -KILL -$__j 2>/dev/null
rm -f ${STATE}/job.$1
exit $__rc`;

/** Kills the process group of exec $1, waiting briefly for its job file. */
const KILL = `f=${STATE}/job.$1
i=0
while [ ! -s "$f" ] && [ $i -lt 20 ]; do sleep 0.1; i=$((i + 1)); done
[ -s "$f" ] && kill -KILL -"$(cat "$f")"`;

/** How long a killed command may take to close its output. */
const KILL_GRACE_MS = 3000;

// ---------------------------------------------------------------- context

/** What the sandboxes of one factory share. */
class DockerContext {
	readonly engine: DockerEngine;
	readonly limiter: CreationLimiter;
	readonly labels: Record<string, string>;
	/** Containers and images made and removed, for tests and health reports. */
	readonly counts = {
		containersCreated: 0,
		containersRemoved: 0,
		imagesCreated: 0,
		imagesRemoved: 0,
	};

	constructor(readonly options: DockerOptions) {
		this.engine = new DockerEngine(options.socketPath);
		this.limiter =
			options.limiter ?? new CreationLimiter(options.maxConcurrentCreates);
		this.labels = { ...options.labels, [TRELLIS_LABEL]: "1" };
	}

	get tools(): readonly string[] {
		return this.options.tools ?? DEFAULT_TOOLS;
	}

	mutates(call: Call): boolean {
		return this.options.mutates
			? this.options.mutates(call)
			: defaultMutates(call, this.tools);
	}

	/**
	 * Creates and starts a container of `image` under the creation limit,
	 * then sets up its shell state (outside the limit: an exec is cheap for
	 * the engine). A container that fails to come up is removed.
	 */
	async createContainer(image: string, name: string): Promise<string> {
		const options = this.options;
		const id = await this.limiter.run(async () => {
			const created = await this.engine.json<{ Id: string }>(
				"POST",
				"/containers/create",
				{
					query: { name },
					body: {
						Image: image,
						// tini as PID 1 reaps what killed commands leave behind.
						Cmd: ["/bin/sh", "-c", "while :; do sleep 86400; done"],
						Entrypoint: [],
						WorkingDir: options.workdir ?? "/work",
						Env: Object.entries(options.env ?? {}).map(([k, v]) => `${k}=${v}`),
						Labels: { ...this.labels, "trellis.sandbox": name },
						NetworkDisabled: !options.network,
						HostConfig: {
							Init: true,
							NetworkMode: options.network ? "bridge" : "none",
							...options.hostConfig,
						},
					},
				},
			);
			this.counts.containersCreated++;
			try {
				await this.engine.json("POST", `/containers/${enc(created.Id)}/start`);
			} catch (err) {
				await this.removeContainer(created.Id);
				throw err;
			}
			return created.Id;
		});
		try {
			const init = await this.execRaw(id, [
				"/bin/sh",
				"-c",
				INIT,
				"sh",
				options.workdir ?? "/work",
			]);
			if (init.exitCode !== 0)
				throw new Error(
					`docker: setting up the shell in ${image} failed (${init.exitCode}): ${init.output.toString("utf8")}`,
				);
		} catch (err) {
			await this.removeContainer(id);
			throw err;
		}
		return id;
	}

	async removeContainer(id: string): Promise<void> {
		await this.engine.removeContainer(id);
		this.counts.containersRemoved++;
	}

	async removeImage(name: string): Promise<void> {
		if (await this.engine.removeImage(name)) this.counts.imagesRemoved++;
	}

	/**
	 * Commits a container to `repo:tag` without pausing it. Past
	 * `maxLayers` the filesystem is exported and imported as one layer
	 * instead (also without pausing): the container's config does not need
	 * carrying over, since every container gets its command, directory and
	 * labels at creation and every exec its environment from the state dir.
	 */
	async commit(container: string, repo: string, tag: string): Promise<string> {
		const info = await this.engine.inspectContainer(container);
		const image = await this.engine.inspectImage(info.Image);
		const depth = image.RootFS.Layers?.length ?? 0;
		const labels = Object.entries(this.labels).map(
			([k, v]) => `LABEL ${k}=${JSON.stringify(v)}`,
		);
		if (depth < (this.options.maxLayers ?? DEFAULT_MAX_LAYERS)) {
			const { Id } = await this.engine.json<{ Id: string }>("POST", "/commit", {
				query: { container, repo, tag, pause: false, changes: labels },
			});
			this.counts.imagesCreated++;
			return Id;
		}
		const exported = await this.engine.request(
			"GET",
			`/containers/${enc(container)}/export`,
		);
		if ((exported.statusCode ?? 500) >= 400)
			throw errorOf(
				exported.statusCode,
				(await readAll(exported)).toString("utf8"),
			);
		const res = await this.engine.request("POST", "/images/create", {
			query: { fromSrc: "-", repo, tag, changes: labels },
			body: exported,
			contentType: "application/x-tar",
		});
		const text = (await readAll(res)).toString("utf8");
		if ((res.statusCode ?? 500) >= 400) throw errorOf(res.statusCode, text);
		const failed = streamError(text);
		if (failed) throw new DockerError(500, failed);
		this.counts.imagesCreated++;
		return (await this.engine.inspectImage(`${repo}:${tag}`)).Id;
	}

	/**
	 * `docker save` of an image, streamed: without the template's layers
	 * when snapshots are thin (see {@link DockerOptions.thinSnapshots}),
	 * optionally gzipped. Template layers are recognised by their size as
	 * they stream past, so they are never held in memory, and checked
	 * against the archive's manifest at the end; an archive where the check
	 * fails (a new layer of a template layer's size) is saved again whole.
	 */
	async save(image: string): Promise<Uint8Array> {
		const thin = this.options.thinSnapshots !== false;
		const template = thin ? await this.#templateLayers() : undefined;
		let tar: Buffer | undefined;
		if (template) {
			const saved = await this.#saveStream(image, (e) => !template.has(e));
			tar = thinArchive(saved, template);
		}
		tar ??= archive(await this.#saveStream(image, () => true));
		return this.options.compress === false
			? tar
			: await gzip(tar, { level: 1 });
	}

	async #saveStream(
		image: string,
		keep: (entry: TarEntry) => boolean,
	): Promise<FilteredTar> {
		const res = await this.engine.request("GET", `/images/${enc(image)}/get`);
		if ((res.statusCode ?? 500) >= 400)
			throw errorOf(res.statusCode, (await readAll(res)).toString("utf8"));
		return filterTar(res, keep);
	}

	/**
	 * `docker load` of a snapshot, tagged `repo:tag` for the one sandbox that
	 * will own it. Snapshots are saved by image id, so the archive names no
	 * tag and two sandboxes restoring the same snapshot never share one.
	 *
	 * The engine tags whatever an archive names, and a snapshot comes from
	 * outside: one naming the template image would swap the image every
	 * fresh sandbox runs. So an archive that names any image is refused
	 * before it reaches the engine ({@link refuseNamedArchive}), and should
	 * the engine still report a name (a tar our reader saw otherwise than
	 * the engine's), the template's tag is put back where it was.
	 */
	async load(data: Uint8Array, repo: string, tag: string): Promise<string> {
		await refuseNamedArchive(data);
		const template = this.options.image ?? DEFAULT_IMAGE;
		const imageId = (name: string) =>
			this.engine.inspectImage(name).then(
				(image) => image.Id,
				() => null,
			);
		const before = await imageId(template);
		const res = await this.engine.request("POST", "/images/load", {
			query: { quiet: true },
			body: data,
			contentType: "application/x-tar",
		});
		const text = (await readAll(res)).toString("utf8");
		const failed =
			(res.statusCode ?? 500) >= 400
				? errorOf(res.statusCode, text).message
				: streamError(text);
		if (failed && /layer\.tar: no such file/.test(failed))
			throw new DockerError(
				409,
				`load: the snapshot leaves out its template image's layers and ` +
					`this engine does not have them (build the same template ` +
					`image here, or snapshot with thinSnapshots: false): ${failed}`,
			);
		if (failed) throw new DockerError(400, `load: ${failed}`);
		const named = streamLines(text).flatMap(
			(m) => /^Loaded image: (\S+)/.exec(m.stream ?? "")?.[1] ?? [],
		);
		if (named.length > 0) {
			// A rebuild of the template during a load that names nothing is
			// left alone: only a load that tagged something moves it back.
			if ((await imageId(template)) !== before) {
				if (before === null) await this.engine.removeImage(template);
				else
					await this.engine.json("POST", `/images/${enc(before)}/tag`, {
						query: { repo: repoOf(template), tag: tagOf(template) },
					});
			}
			throw new DockerError(
				400,
				`load: the snapshot names images (${named.join(", ")}); ` +
					`a snapshot must name none`,
			);
		}
		const loaded = streamLines(text)
			.map((m) => /^Loaded image ID: (\S+)/.exec(m.stream ?? "")?.[1])
			.find((id) => id !== undefined);
		if (!loaded)
			throw new DockerError(400, `load: no image in the archive: ${text}`);
		await this.engine.json("POST", `/images/${enc(loaded)}/tag`, {
			query: { repo, tag },
		});
		this.counts.imagesCreated++;
		return `${repo}:${tag}`;
	}

	/**
	 * The template image's layers, by the size of their tar in a save, for
	 * {@link save} to recognise. Learned once per engine and image, from
	 * one save of the template that keeps nothing in memory.
	 */
	async #templateLayers(): Promise<TemplateLayers> {
		const name = this.options.image ?? DEFAULT_IMAGE;
		const { Id } = await this.engine.inspectImage(name);
		const key = `${this.engine.socketPath}\n${Id}`;
		let layers = templateLayers.get(key);
		if (!layers) {
			layers = this.#saveStream(Id, (e) => !e.name.endsWith("/layer.tar")).then(
				(saved) => {
					const { manifest, config } = savedImage(saved);
					const sizes = new Map(saved.skipped.map((e) => [e.name, e.size]));
					return new TemplateLayers(
						config.rootfs.diff_ids,
						manifest.Layers.map((layer) => sizes.get(layer) ?? -1),
					);
				},
			);
			templateLayers.set(key, layers);
			// A failed lookup is tried again next time.
			layers.catch(() => templateLayers.delete(key));
		}
		return layers;
	}

	/** Runs argv in a container and collects all its output (internal commands). */
	async execRaw(
		container: string,
		argv: string[],
	): Promise<{ output: Buffer; exitCode: number }> {
		const chunks: Buffer[] = [];
		const { exitCode } = await this.exec(container, argv, (chunk) => {
			chunks.push(chunk);
		});
		return { output: Buffer.concat(chunks), exitCode };
	}

	/**
	 * Creates and starts an exec, passes its output (stdout and stderr, in
	 * arrival order) to `onData`, and returns its exit code. `abort` cuts the
	 * stream off, for a command that will not close it.
	 */
	async exec(
		container: string,
		argv: string[],
		onData: (chunk: Buffer) => void,
		abort?: AbortSignal,
	): Promise<{ exitCode: number; aborted: boolean }> {
		const { Id } = await this.engine.json<{ Id: string }>(
			"POST",
			`/containers/${enc(container)}/exec`,
			{
				body: {
					Cmd: argv,
					AttachStdin: false,
					AttachStdout: true,
					AttachStderr: true,
					Tty: false,
				},
			},
		);
		// Without an Upgrade header the engine still hijacks the connection
		// and writes a raw stream until the process ends, then closes it.
		const res = await this.engine.request("POST", `/exec/${Id}/start`, {
			body: { Detach: false, Tty: false },
		});
		if ((res.statusCode ?? 500) >= 400)
			throw errorOf(res.statusCode, (await readAll(res)).toString("utf8"));
		let aborted = false;
		const onAbort = () => {
			aborted = true;
			res.destroy();
		};
		if (abort?.aborted) onAbort();
		else abort?.addEventListener("abort", onAbort, { once: true });
		try {
			await demux(res, onData);
		} catch (err) {
			if (!aborted) throw err;
		} finally {
			abort?.removeEventListener("abort", onAbort);
		}
		if (aborted) return { exitCode: -1, aborted };
		return { exitCode: await this.#exitCode(Id), aborted };
	}

	/**
	 * The exit code of a finished exec. The engine may close the stream a
	 * moment before it records the exit, so a still-running answer is asked
	 * again.
	 */
	async #exitCode(execId: string): Promise<number> {
		for (let i = 0; ; i++) {
			const info = await this.engine.json<{
				Running: boolean;
				ExitCode: number | null;
			}>("GET", `/exec/${execId}/json`);
			if (!info.Running && info.ExitCode !== null) return info.ExitCode;
			if (i >= 1000)
				throw new Error(`docker: exec ${execId} has no exit code after 10 s`);
			await new Promise((resolve) => setTimeout(resolve, 10));
		}
	}
}

/**
 * Reads a multiplexed exec stream: frames of an 8-byte header (stream type,
 * three zero bytes, big-endian payload length) and the payload.
 */
async function demux(
	stream: Readable,
	onData: (chunk: Buffer) => void,
): Promise<void> {
	let pending: Buffer = Buffer.alloc(0);
	for await (const chunk of stream) {
		pending =
			pending.length === 0
				? (chunk as Buffer)
				: Buffer.concat([pending, chunk as Buffer]);
		while (pending.length >= 8) {
			const size = pending.readUInt32BE(4);
			if (pending.length < 8 + size) break;
			if (size > 0) onData(pending.subarray(8, 8 + size));
			pending = pending.subarray(8 + size);
		}
	}
}

/** An entry of a tar archive. */
interface TarEntry {
	name: string;
	/** Bytes of content (not counting headers and padding). */
	size: number;
}

/** A tar archive, filtered: the raw blocks kept and what was left out. */
interface FilteredTar {
	/** Raw blocks of the kept entries, headers included, in order. */
	blocks: Buffer[];
	/** The contents of kept entries at the top level (manifest, config). */
	files: Map<string, Buffer>;
	skipped: TarEntry[];
}

/** Below this size a layer is not worth leaving out of a snapshot. */
const MIN_THIN_LAYER = 64 << 10;

/**
 * The template image's layers: diff ids, base first, and the size of each
 * layer's tar in a `docker save`.
 */
class TemplateLayers {
	readonly #sizes: Set<number>;
	constructor(
		readonly diffIds: string[],
		readonly sizes: number[],
	) {
		this.#sizes = new Set(sizes.filter((size) => size >= MIN_THIN_LAYER));
	}

	/** Whether an entry of a save may be one of these layers' tars. */
	has(entry: TarEntry): boolean {
		return entry.name.endsWith("/layer.tar") && this.#sizes.has(entry.size);
	}
}

/** Template layers by engine socket and image id. */
const templateLayers = new Map<string, Promise<TemplateLayers>>();

/**
 * Streams a tar archive, keeping the entries `keep` says yes to. Entries
 * left out are never buffered. Reads the ustar name and prefix and a
 * preceding pax (`x`) or GNU long-name (`L`) header, which go with the
 * entry they precede, a pax `size`, and names as the engine's untar
 * cleans them (`./a`, `b/../a` are `a`), so that what
 * {@link refuseNamedArchive} reads is what `docker load` would.
 */
async function filterTar(
	stream: Readable,
	keep: (entry: TarEntry) => boolean,
): Promise<FilteredTar> {
	const out: FilteredTar = { blocks: [], files: new Map(), skipped: [] };
	let pending: Buffer = Buffer.alloc(0);
	let meta: Buffer[] = [];
	let longName: string | undefined;
	let paxSize: number | undefined;
	let current: {
		entry: TarEntry;
		keep: boolean;
		left: number;
		data: Buffer[];
	} | null = null;
	let ended = false;
	for await (const chunk of stream) {
		if (ended) continue;
		pending =
			pending.length === 0
				? (chunk as Buffer)
				: Buffer.concat([pending, chunk as Buffer]);
		while (pending.length > 0) {
			if (current) {
				const n = Math.min(current.left, pending.length);
				if (current.keep) {
					current.data.push(pending.subarray(0, n));
					out.blocks.push(pending.subarray(0, n));
				}
				current.left -= n;
				pending = pending.subarray(n);
				if (current.left > 0) break;
				const { entry, data } = current;
				if (current.keep && !entry.name.includes("/"))
					out.files.set(
						entry.name,
						Buffer.concat(data).subarray(0, entry.size),
					);
				if (!current.keep) out.skipped.push(entry);
				current = null;
				continue;
			}
			if (pending.length < 512) break;
			const header = pending.subarray(0, 512);
			if (header.every((b) => b === 0)) {
				ended = true;
				break;
			}
			const field = (from: number, length: number) =>
				header
					.subarray(from, from + length)
					.toString("utf8")
					.replace(/\0.*$/s, "");
			const sizeField = field(124, 12).trim() || "0";
			// Base-256 sizes (GNU, past 8 GiB) are not read here: refuse
			// rather than lose step with the entries.
			if (!/^[0-7]+$/.test(sizeField))
				throw new Error("docker save: an entry size that is not octal");
			const type = String.fromCharCode(header[156]!);
			const isMeta = type === "x" || type === "L" || type === "g";
			// A pax size is the size of the entry it precedes.
			const size = (isMeta ? undefined : paxSize) ?? parseInt(sizeField, 8);
			const padded = Math.ceil(size / 512) * 512;
			if (isMeta) {
				// Small: wait until it is here whole.
				if (pending.length < 512 + padded) break;
				const data = pending.subarray(512, 512 + size).toString("utf8");
				if (type === "x") {
					longName = /(?:^|\n)\d+ path=([^\n]*)\n/.exec(data)?.[1] ?? longName;
					const sized = /(?:^|\n)\d+ size=(\d+)\n/.exec(data)?.[1];
					if (sized !== undefined) paxSize = Number(sized);
				}
				if (type === "L") longName = data.replace(/\0.*$/s, "");
				meta.push(pending.subarray(0, 512 + padded));
				pending = pending.subarray(512 + padded);
				continue;
			}
			const prefix = field(345, 155);
			const name = path.posix
				.normalize(longName ?? (prefix ? `${prefix}/` : "") + field(0, 100))
				.replace(/^(\.?\/)+/, "");
			const entry = { name, size };
			const kept = keep(entry);
			if (kept) out.blocks.push(...meta, header);
			meta = [];
			longName = undefined;
			paxSize = undefined;
			current = { entry, keep: kept, left: padded, data: [] };
			pending = pending.subarray(512);
		}
	}
	if (current || !ended)
		throw new Error("docker save: the archive is cut short");
	return out;
}

/** A filtered archive as bytes: its blocks and the two zero blocks that end a tar. */
function archive(saved: FilteredTar): Buffer {
	return Buffer.concat([...saved.blocks, Buffer.alloc(1024)]);
}

/** The manifest and config of a one-image `docker save` archive. */
function savedImage(saved: FilteredTar): {
	manifest: { Config: string; Layers: string[] };
	config: { rootfs: { diff_ids: string[] } };
} {
	const json = (name: string) => {
		const data = saved.files.get(name);
		if (!data) throw new Error(`docker save: no ${name} in the archive`);
		return JSON.parse(data.toString("utf8"));
	};
	const [manifest] = json("manifest.json");
	if (!manifest) throw new Error("docker save: an empty manifest");
	return { manifest, config: json(manifest.Config) };
}

/**
 * A save with the template's layers left out as an archive, or undefined
 * when what was left out is not exactly template layers in the template's
 * positions. `docker load` takes a layer it already has (same diff ids
 * from the base up) from its own store without opening the missing file.
 */
function thinArchive(
	saved: FilteredTar,
	template: TemplateLayers,
): Buffer | undefined {
	const { manifest, config } = savedImage(saved);
	const diffIds = config.rootfs.diff_ids;
	let shared = 0;
	while (
		shared < template.diffIds.length &&
		diffIds[shared] === template.diffIds[shared]
	)
		shared++;
	const ok = saved.skipped.every((entry) => {
		const at = manifest.Layers.indexOf(entry.name);
		return at >= 0 && at < shared && template.sizes[at] === entry.size;
	});
	return ok ? archive(saved) : undefined;
}

/**
 * Throws unless `data` is a tar (gzipped or not) of one `docker save` that
 * names no image: a manifest.json whose entries have no RepoTags, no legacy
 * `repositories` file (which a load without a manifest reads for tags),
 * and no image-name annotations in an OCI index.json (newer engines read
 * those). Only top-level entries are read; layers stream past.
 */
export async function refuseNamedArchive(data: Uint8Array): Promise<void> {
	const bytes = Buffer.from(data.buffer, data.byteOffset, data.byteLength);
	const refuse = (why: string) => {
		throw new DockerError(400, `load: the snapshot ${why}`);
	};
	let stream: Readable = Readable.from([bytes]);
	if (bytes[0] === 0x1f && bytes[1] === 0x8b)
		// Chunks of 1 MiB, not zlib's 16 KiB: the reader's per-chunk work
		// then stops dominating, and a 128 MiB archive is read in about a
		// quarter of the time (docs/benchmarks-e2e.md).
		stream = stream.pipe(createGunzip({ chunkSize: 1 << 20 }));
	else if (bytes.subarray(257, 262).toString("latin1") !== "ustar")
		refuse("is neither a tar nor a gzipped tar");
	let saved: FilteredTar;
	try {
		saved = await filterTar(stream, (entry) => !entry.name.includes("/"));
	} catch (err) {
		return refuse(`is not a readable archive: ${(err as Error).message}`);
	}
	const json = (name: string): unknown => {
		const file = saved.files.get(name);
		if (file === undefined) return undefined;
		try {
			return JSON.parse(file.toString("utf8"));
		} catch {
			// A link or a directory by that name reads as empty here.
			return refuse(`has a ${name} that is not JSON`);
		}
	};
	if (saved.files.has("repositories")) refuse("names images (repositories)");
	const manifest = json("manifest.json");
	if (!Array.isArray(manifest) || manifest.length === 0)
		refuse("has no manifest.json listing its image");
	for (const entry of manifest as { RepoTags?: unknown }[]) {
		const tags = entry?.RepoTags;
		if (tags !== undefined && tags !== null && !isEmptyArray(tags))
			refuse(`names images (${JSON.stringify(tags)} in manifest.json)`);
	}
	const index = json("index.json") as
		{ manifests?: { annotations?: Record<string, unknown> }[] } | undefined;
	for (const m of index?.manifests ?? []) {
		const names = Object.keys(m?.annotations ?? {}).filter((k) =>
			/^(io\.containerd\.image\.name|org\.opencontainers\.image\.ref\.name)$/.test(
				k,
			),
		);
		if (names.length > 0) refuse(`names images (${names[0]} in index.json)`);
	}
}

function isEmptyArray(value: unknown): boolean {
	return Array.isArray(value) && value.length === 0;
}

/** The repository of an image reference (`a/b:t` → `a/b`). */
function repoOf(ref: string): string {
	const colon = ref.lastIndexOf(":");
	return colon > ref.lastIndexOf("/") ? ref.slice(0, colon) : ref;
}

/** The tag of an image reference, `latest` when it has none. */
function tagOf(ref: string): string {
	const colon = ref.lastIndexOf(":");
	return colon > ref.lastIndexOf("/") ? ref.slice(colon + 1) : "latest";
}

/** The messages of a JSON-lines progress stream (load, import). */
function streamLines(text: string): { stream?: string; error?: string }[] {
	return text.split("\n").flatMap((line) => {
		try {
			return line.trim() === "" ? [] : [JSON.parse(line)];
		} catch {
			return []; // A line that is not JSON carries nothing we read.
		}
	});
}

/** The first `error` of a JSON-lines progress stream, if any. */
function streamError(text: string): string | undefined {
	return streamLines(text).find((m) => m.error)?.error;
}

function newName(): string {
	return randomBytes(8).toString("hex");
}

// ---------------------------------------------------------------- sandbox

/** @internal How a sandbox comes up: from the template, or an image it owns. */
interface Origin {
	context: DockerContext;
	/** An image made for this sandbox alone, removed when it stops. */
	ownImage?: string;
}

/** A sandbox that is a Docker container; see the module comment. */
export class DockerSandbox implements Sandbox {
	readonly driver = DOCKER_DRIVER;
	/** Also the container's `trellis.sandbox` label and its name's suffix. */
	readonly name = newName();
	readonly #context: DockerContext;
	#container: string | null = null;
	#ownImage: string | null;
	#stopped = false;
	/** Execs running now, each with a way to kill it; `stop()` uses it. */
	#running = new Set<AbortController>();
	/** The start in progress, so two callers share one container. */
	#starting: Promise<void> | null = null;
	/**
	 * The last exec queued: execs run one at a time, as in a terminal. Two
	 * at once would each start from the same saved directory and
	 * environment, and the one to finish last would overwrite the other's.
	 */
	#queue: Promise<unknown> = Promise.resolve();

	/**
	 * Creates nothing: `start()` creates the container. `origin` is for the
	 * factory and for forks; leave it out.
	 */
	constructor(options: DockerOptions = {}, origin?: Origin) {
		this.#context = origin?.context ?? new DockerContext(options);
		this.#ownImage = origin?.ownImage ?? null;
	}

	/** The container's id; only once started. */
	get containerId(): string {
		if (this.#container === null)
			throw new Error("the docker sandbox is not started");
		return this.#container;
	}

	/** Creates and starts the container (under the creation limit). */
	async start(): Promise<void> {
		if (this.#stopped) throw new Error("the docker sandbox is stopped");
		if (this.#container !== null) return;
		this.#starting ??= this.#create().finally(() => {
			this.#starting = null;
		});
		return this.#starting;
	}

	async #create(): Promise<void> {
		const image =
			this.#ownImage ?? this.#context.options.image ?? DEFAULT_IMAGE;
		const id = await this.#context.createContainer(
			image,
			`trellis-${this.name}`,
		);
		// stop() may have run while the container was being created.
		if (this.#stopped) {
			await this.#context.removeContainer(id);
			return;
		}
		this.#container = id;
	}

	/**
	 * Runs the call's command with `/bin/sh` in the container, in the
	 * directory and with the exported variables the previous command left.
	 * stdout and stderr come through one pipe, in the order written, cut at
	 * the output cap. A timeout kills the command's process group and gives
	 * exit code 124; what it did to files stays, its `cd`/`export` do not.
	 * Execs on one sandbox run one at a time, in the order called.
	 */
	exec(call: Call, options: DockerExecOptions = {}): Promise<DockerExecResult> {
		const result = this.#queue.then(() => this.#exec(call, options));
		this.#queue = result.catch(() => {});
		return result;
	}

	async #exec(
		call: Call,
		options: DockerExecOptions,
	): Promise<DockerExecResult> {
		const context = this.#context;
		if (!context.tools.includes(call.tool))
			throw new TypeError(`the docker driver does not run tool ${call.tool}`);
		const command = commandOf(call);
		const container = this.containerId;
		const timeoutMs = timeLimit(
			command.timeoutMs,
			options.timeoutMs,
			context.options.timeoutMs ?? 60_000,
		);
		const cap =
			options.maxOutputBytes ?? context.options.maxOutputBytes ?? 1 << 20;
		const token = newName();
		const started = performance.now();
		const chunks: Buffer[] = [];
		let kept = 0;
		let dropped = 0;
		const onData = (chunk: Buffer) => {
			const room = cap - kept;
			if (room > 0) {
				chunks.push(chunk.subarray(0, room));
				kept += Math.min(room, chunk.length);
			}
			dropped += Math.max(0, chunk.length - Math.max(room, 0));
		};
		const cutOff = new AbortController();
		this.#running.add(cutOff);
		let timedOut = false;
		let grace: NodeJS.Timeout | undefined;
		const timer = setTimeout(() => {
			timedOut = true;
			this.#kill(container, token);
			// A process that left the session (setsid) keeps the output
			// open; stop waiting for it.
			grace = setTimeout(() => cutOff.abort(), KILL_GRACE_MS);
		}, timeoutMs);
		let exitCode: number;
		try {
			({ exitCode } = await context.exec(
				container,
				[
					"/bin/sh",
					"-c",
					OUTER,
					"sh",
					token,
					INNER,
					command.cwd ?? "",
					command.cmd,
				],
				onData,
				cutOff.signal,
			));
		} finally {
			clearTimeout(timer);
			clearTimeout(grace);
			this.#running.delete(cutOff);
		}
		if (this.#stopped) throw new Error("the docker sandbox was stopped");
		let output = Buffer.concat(chunks).toString("utf8");
		if (dropped > 0) output += `\n[output truncated: ${dropped} more bytes]\n`;
		if (timedOut) output += `\n[timed out after ${timeoutMs} ms]\n`;
		return {
			output,
			exitCode: timedOut ? 124 : exitCode,
			execMs: performance.now() - started,
			timedOut,
			droppedBytes: dropped,
		};
	}

	/**
	 * A commit of the container (not paused) as a new, started sandbox that
	 * owns the committed image. Same files, directory and environment.
	 */
	async fork(): Promise<DockerSandbox> {
		const context = this.#context;
		const twin = new DockerSandbox(context.options, { context });
		const image = `${SANDBOX_REPO}:${twin.name}`;
		await context.commit(this.containerId, SANDBOX_REPO, twin.name);
		twin.#ownImage = image;
		try {
			await twin.start();
		} catch (err) {
			await twin.stop();
			throw err;
		}
		return twin;
	}

	/** The container's state as an image archive: commit, `docker save` by id. */
	async snapshot(): Promise<{ driver: string; data: Uint8Array }> {
		const context = this.#context;
		const tag = newName();
		const id = await context.commit(this.containerId, SNAPSHOT_REPO, tag);
		try {
			return { driver: this.driver, data: await context.save(id) };
		} finally {
			await context.removeImage(`${SNAPSHOT_REPO}:${tag}`);
		}
	}

	/**
	 * Loads a docker snapshot and moves the sandbox onto a container of it;
	 * the old container and its image go.
	 */
	async restore(source: SnapshotSource): Promise<void> {
		if (source.ref.driver !== this.driver)
			throw new TypeError(`cannot restore a ${source.ref.driver} snapshot`);
		if (this.#stopped) throw new Error("the docker sandbox is stopped");
		const context = this.#context;
		const data = await source.read();
		const image = await context.load(data, SANDBOX_REPO, newName());
		let id: string;
		try {
			id = await context.createContainer(image, `trellis-${newName()}`);
		} catch (err) {
			await context.removeImage(image);
			throw err;
		}
		const [oldContainer, oldImage] = [this.#container, this.#ownImage];
		this.#container = id;
		this.#ownImage = image;
		if (oldContainer !== null) await context.removeContainer(oldContainer);
		if (oldImage !== null) await context.removeImage(oldImage);
	}

	/** Removes the container (forced) and the image made for it. Idempotent. */
	async stop(): Promise<void> {
		this.#stopped = true;
		for (const running of this.#running) running.abort();
		const [container, image] = [this.#container, this.#ownImage];
		this.#container = null;
		this.#ownImage = null;
		if (container !== null) await this.#context.removeContainer(container);
		if (image !== null) await this.#context.removeImage(image);
	}

	/** See {@link DockerOptions.mutates}. */
	mutates(call: Call): boolean {
		return this.#context.mutates(call);
	}

	/** @internal Sandboxes made by the factory share its context. */
	static _in(context: DockerContext, ownImage?: string): DockerSandbox {
		return new DockerSandbox(context.options, { context, ownImage });
	}

	/** Kills exec `token`'s process group; failures only mean it is gone. */
	#kill(container: string, token: string): void {
		this.#context
			.execRaw(container, ["/bin/sh", "-c", KILL, "sh", token])
			.catch(() => {});
	}
}

// ---------------------------------------------------------------- factory

/** What a factory has done, for tests and the host's health report. */
export interface DockerStats {
	/** Container creations running now, the most ever at once, and done. */
	creating: number;
	maxCreating: number;
	creations: number;
	limit: number;
	containersCreated: number;
	containersRemoved: number;
	imagesCreated: number;
	imagesRemoved: number;
}

/**
 * Starts Docker sandboxes of one template (image and network) for the
 * executor and the host. Its sandboxes, their forks and restores share one
 * engine connection and one creation limit.
 */
export class DockerSandboxFactory implements SandboxFactory {
	readonly driver = DOCKER_DRIVER;
	readonly #context: DockerContext;

	constructor(options: DockerOptions = {}) {
		this.#context = new DockerContext(options);
	}

	/** The engine, e.g. to `ping()` it before offering the driver. */
	get engine(): DockerEngine {
		return this.#context.engine;
	}

	/** A fresh container of the template's image, started. */
	async start(): Promise<DockerSandbox> {
		const sandbox = DockerSandbox._in(this.#context);
		await sandbox.start();
		return sandbox;
	}

	/** A container of a loaded docker snapshot, started; the image is its own. */
	async restore(source: SnapshotSource): Promise<DockerSandbox> {
		if (source.ref.driver !== DOCKER_DRIVER)
			throw new TypeError(`cannot restore a ${source.ref.driver} snapshot`);
		const context = this.#context;
		const image = await context.load(
			await source.read(),
			SANDBOX_REPO,
			newName(),
		);
		const sandbox = DockerSandbox._in(context, image);
		try {
			await sandbox.start();
		} catch (err) {
			await sandbox.stop();
			throw err;
		}
		return sandbox;
	}

	/** See {@link DockerOptions.mutates}. */
	mutates(call: Call): boolean {
		return this.#context.mutates(call);
	}

	/** Counters of creations and removals. */
	get stats(): DockerStats {
		const { limiter, counts } = this.#context;
		return {
			creating: limiter.active,
			maxCreating: limiter.maxActive,
			creations: limiter.total,
			limit: limiter.limit,
			...counts,
		};
	}
}

/** A {@link DockerSandboxFactory}: Docker sandboxes for the executor and the host. */
export function dockerFactory(
	options: DockerOptions = {},
): DockerSandboxFactory {
	return new DockerSandboxFactory(options);
}

/**
 * Removes every container, then every image, carrying all of `labels`
 * (default `trellis=1`): what a crashed host or test left behind. Images go
 * newest first, so children go before their parents.
 */
export async function removeLabelled(
	labels: Record<string, string> = { [TRELLIS_LABEL]: "1" },
	engine = new DockerEngine(),
): Promise<{ containers: number; images: number }> {
	const filters = JSON.stringify({
		label: Object.entries(labels).map(([k, v]) => `${k}=${v}`),
	});
	const containers = await engine.json<{ Id: string }[]>(
		"GET",
		"/containers/json",
		{ query: { all: true, filters } },
	);
	await Promise.all(containers.map((c) => engine.removeContainer(c.Id)));
	const images = await engine.json<
		{ Id: string; Created: number; RepoTags: string[] | null }[]
	>("GET", "/images/json", { query: { all: true, filters } });
	images.sort((a, b) => b.Created - a.Created);
	for (const image of images) {
		for (const tag of image.RepoTags ?? []) await engine.removeImage(tag);
		await engine.removeImage(image.Id);
	}
	return { containers: containers.length, images: images.length };
}
