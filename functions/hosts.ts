/**
 * Container hosts register here with a `host` key and keep themselves up
 * with heartbeats. The Worker signs what it sends them with the secret it
 * issues at registration (core/signing.ts).
 */
import { Hono } from "hono";
import { LIMITS } from "../core/api.ts";
import { now } from "../core/clock.ts";
import {
	HeartbeatRequest,
	RegisterHostRequest,
	type HostInfo,
	type RegisterHostResponse,
} from "../core/host-api.ts";
import type { AppEnv } from "./app.ts";
import { allow } from "./auth.ts";
import { apiError } from "./errors.ts";
import { jsonBody, valid } from "./validate.ts";

export const hosts = new Hono<AppEnv>();

/** How often a host must check in; three missed beats and it is down. */
export const HEARTBEAT_MS = 5000;

function projectOf(c: {
	get(k: "principal"): AppEnv["Variables"]["principal"];
}) {
	const p = c.get("principal");
	if (p.kind !== "key") throw apiError(403, "forbidden", "use a project key");
	return p.project;
}

hosts.post(
	"/",
	allow(["host", "admin"]),
	jsonBody(LIMITS.adminBody),
	valid("json", RegisterHostRequest),
	async (c) => {
		const req = c.req.valid("json");
		const project = projectOf(c);
		const id = crypto.randomUUID();
		const secretBytes = new Uint8Array(32);
		crypto.getRandomValues(secretBytes);
		const secret = Buffer.from(secretBytes).toString("hex");
		const at = now();
		await c.env.DB.prepare(
			`insert into hosts (id, project_id, url, name, capacity, drivers, secret, status, last_seen_at, registered_at)
			 values (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'up', ?8, ?8)`,
		)
			.bind(
				id,
				project,
				req.url,
				req.name ?? null,
				req.capacity,
				JSON.stringify(req.drivers),
				secret,
				at,
			)
			.run();
		return c.json(
			{ id, secret, heartbeatMs: HEARTBEAT_MS } satisfies RegisterHostResponse,
			201,
		);
	},
);

hosts.post(
	"/:id/heartbeat",
	allow(["host", "admin"]),
	jsonBody(LIMITS.adminBody),
	valid("json", HeartbeatRequest),
	async (c) => {
		const req = c.req.valid("json");
		const r = await c.env.DB.prepare(
			`update hosts set status = 'up', last_seen_at = ?3, sandboxes = ?4, busy = ?5
			 where id = ?1 and project_id = ?2`,
		)
			.bind(c.req.param("id"), projectOf(c), now(), req.sandboxes, req.busy)
			.run();
		// Unknown (or another project's) host: it should register again.
		if (r.meta.changes === 0) {
			throw apiError(404, "host_not_found", "no such host; register again");
		}
		return c.json({ ok: true });
	},
);

hosts.delete("/:id", allow(["host", "admin"]), async (c) => {
	const r = await c.env.DB.prepare(
		"delete from hosts where id = ?1 and project_id = ?2",
	)
		.bind(c.req.param("id"), projectOf(c))
		.run();
	if (r.meta.changes === 0)
		throw apiError(404, "host_not_found", "no such host");
	return c.json({ id: c.req.param("id"), deregistered: true });
});

hosts.get("/", allow(["trainer", "host", "admin"]), async (c) => {
	const { results } = await c.env.DB.prepare(
		`select id, url, name, capacity, drivers, status, last_seen_at as lastSeenAt,
		   sandboxes, busy
		 from hosts where project_id = ?1 order by registered_at`,
	)
		.bind(projectOf(c))
		.all<Omit<HostInfo, "drivers"> & { drivers: string }>();
	const stale = now() - 3 * HEARTBEAT_MS;
	return c.json({
		hosts: results.map((h): HostInfo => ({
			...h,
			drivers: JSON.parse(h.drivers),
			status: h.lastSeenAt < stale ? "down" : h.status,
		})),
	});
});
