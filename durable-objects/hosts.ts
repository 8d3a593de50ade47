/**
 * The task graph's view of its project's container hosts: which are up, a
 * pick among them, and signed requests to them. A host that times out,
 * refuses the connection or answers 5xx is marked down in D1 (until its next
 * heartbeat) and the caller moves on to another.
 */
import { now } from "../core/clock.ts";
import type { Driver } from "../core/host-api.ts";
import { sign } from "../core/signing.ts";

/** Missed beats before a silent host counts as down (heartbeats every 5 s). */
const STALE_MS = 15_000;
const LIST_TTL_MS = 2000;

export interface Host {
	id: string;
	url: string;
	drivers: Driver[];
	capacity: number;
	secret: string;
}

/** The host failed (not the request): try another. */
export class HostDown extends Error {
	constructor(
		readonly hostId: string,
		message: string,
	) {
		super(message);
	}
}

/** The host refused the request itself (4xx): retrying elsewhere will not help. */
export class HostRefused extends Error {
	constructor(
		readonly status: number,
		readonly code: string,
		message: string,
	) {
		super(message);
	}
}

export class HostSet {
	#cache: { at: number; hosts: Host[] } | null = null;
	#down = new Set<string>();
	/** Requests in flight per host, to spread load. */
	#busy = new Map<string, number>();

	constructor(
		private readonly db: D1Database,
		private readonly project: () => string,
	) {}

	async #list(): Promise<Host[]> {
		const t = now();
		if (this.#cache && t - this.#cache.at < LIST_TTL_MS)
			return this.#cache.hosts;
		const { results } = await this.db
			.prepare(
				`select id, url, drivers, capacity, secret from hosts
				 where project_id = ?1 and status = 'up' and last_seen_at > ?2
				 order by registered_at`,
			)
			.bind(this.project(), t - STALE_MS)
			.all<Omit<Host, "drivers"> & { drivers: string }>();
		const hosts = results.map((h) => ({
			...h,
			drivers: JSON.parse(h.drivers) as Driver[],
		}));
		this.#cache = { at: t, hosts };
		// Only `up` hosts are listed, and markDown wrote `down`: a host listed
		// again has sent a heartbeat since, so it is back.
		for (const h of hosts) this.#down.delete(h.id);
		return hosts;
	}

	/** An up host with the driver, the least busy first; null when none can serve. */
	async pick(
		driver: Driver,
		exclude: ReadonlySet<string>,
		prefer?: string,
	): Promise<Host | null> {
		const hosts = (await this.#list()).filter(
			(h) =>
				h.drivers.includes(driver) &&
				!exclude.has(h.id) &&
				!this.#down.has(h.id),
		);
		if (hosts.length === 0) return null;
		const preferred = hosts.find((h) => h.id === prefer);
		if (preferred) return preferred;
		return hosts.reduce((a, b) =>
			(this.#busy.get(a.id) ?? 0) / a.capacity <=
			(this.#busy.get(b.id) ?? 0) / b.capacity
				? a
				: b,
		);
	}

	async get(id: string): Promise<Host | null> {
		if (this.#down.has(id)) return null;
		return (await this.#list()).find((h) => h.id === id) ?? null;
	}

	/** Marks a host down here and in D1; its next heartbeat marks it up. */
	async markDown(id: string): Promise<void> {
		this.#down.add(id);
		this.#cache = null;
		await this.db
			.prepare("update hosts set status = 'down' where id = ?1")
			.bind(id)
			.run();
	}

	/** A signed JSON request to a host. */
	async call<T>(
		host: Host,
		method: string,
		path: string,
		body: unknown,
		timeoutMs: number,
	): Promise<T> {
		const text = body === undefined ? "" : JSON.stringify(body);
		const headers: Record<string, string> = sign(
			host.secret,
			method,
			path,
			text,
			now(),
		);
		if (body !== undefined) headers["content-type"] = "application/json";
		this.#busy.set(host.id, (this.#busy.get(host.id) ?? 0) + 1);
		let res: Response;
		try {
			res = await fetch(new URL(path, host.url), {
				method,
				headers,
				body: body === undefined ? undefined : text,
				signal: AbortSignal.timeout(timeoutMs),
			});
		} catch (err) {
			await this.markDown(host.id);
			throw new HostDown(
				host.id,
				`host ${host.id} did not answer ${method} ${path}: ${String(err)}`,
			);
		} finally {
			this.#busy.set(host.id, (this.#busy.get(host.id) ?? 1) - 1);
		}
		const reply = await res.text();
		if (res.status >= 500) {
			await this.markDown(host.id);
			throw new HostDown(
				host.id,
				`host ${host.id} answered ${res.status}: ${reply.slice(0, 200)}`,
			);
		}
		if (!res.ok) {
			let code = "host_refused";
			let message = reply.slice(0, 500);
			try {
				const e = JSON.parse(reply) as {
					error?: { code?: string; message?: string };
				};
				code = e.error?.code ?? code;
				message = e.error?.message ?? message;
			} catch {
				// not JSON: keep the text
			}
			throw new HostRefused(res.status, code, message);
		}
		return JSON.parse(reply) as T;
	}
}
