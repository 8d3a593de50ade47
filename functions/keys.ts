/**
 * API keys: created (shown once), listed, revoked and rotated by an admin of
 * their project or by the root admin key. See functions/auth.ts for how soon
 * a revoked key stops working.
 */
import { Hono } from "hono";
import { z } from "zod";
import {
	CreateKeyRequest,
	LIMITS,
	type CreatedKey,
	type KeyInfo,
	type Role,
} from "../core/api.ts";
import { now } from "../core/clock.ts";
import type { AppEnv, Principal } from "./app.ts";
import { allow, forgetKey, hashKey, newKey } from "./auth.ts";
import { apiError } from "./errors.ts";
import { jsonBody, valid } from "./validate.ts";

export const keys = new Hono<AppEnv>();

const admin = allow(["admin"], { root: true });

/** The longest a rotated key may keep working beside its successor. */
export const MAX_GRACE_SECONDS = 30 * 24 * 3600;

// TODO(core/api.ts): this wire schema belongs beside CreateKeyRequest, where
// the clients take their types from; it lives here until that file's owner
// moves it.
/** `POST /v1/keys/:id/rotate`: how long the old key keeps working. */
export const RotateKeyRequest = z
	.object({
		graceSeconds: z.number().int().min(0).max(MAX_GRACE_SECONDS).optional(),
	})
	.strict();

interface KeyRow {
	project_id: string;
	role: Role;
	name: string | null;
	hash: string;
	revoked_at: number | null;
	expires_at: number | null;
}

/** The project an admin acts on: its own, or (root only) the one it names. */
function projectOf(p: Principal, named: string | undefined): string {
	if (p.kind === "root") {
		if (!named)
			throw apiError(
				400,
				"invalid_request",
				"project: the root key must name a project",
			);
		return named;
	}
	if (named !== undefined && named !== p.project) {
		throw apiError(403, "forbidden", "a key sees only its own project");
	}
	return p.project;
}

/**
 * A key within the caller's reach, by id. Another project's key is reported
 * as missing, not as forbidden: a key must not learn what exists outside its
 * project.
 */
async function ownKey(env: Env, p: Principal, id: string): Promise<KeyRow> {
	const row = await env.DB.prepare(
		"select project_id, role, name, hash, revoked_at, expires_at from api_keys where id = ?1",
	)
		.bind(id)
		.first<KeyRow>();
	if (!row || (p.kind === "key" && row.project_id !== p.project)) {
		throw apiError(404, "key_not_found", "no such key");
	}
	return row;
}

keys.post(
	"/",
	admin,
	jsonBody(LIMITS.adminBody),
	valid("json", CreateKeyRequest),
	async (c) => {
		const req = c.req.valid("json");
		const project = projectOf(c.get("principal"), req.project);
		const exists = await c.env.DB.prepare(
			"select 1 from projects where id = ?1",
		)
			.bind(project)
			.first();
		if (!exists)
			throw apiError(404, "project_not_found", `no project ${project}`);
		const key = newKey();
		const id = crypto.randomUUID();
		await c.env.DB.prepare(
			"insert into api_keys (id, project_id, role, name, hash, created_at) values (?1, ?2, ?3, ?4, ?5, ?6)",
		)
			.bind(id, project, req.role, req.name ?? null, hashKey(key), now())
			.run();
		return c.json(
			{
				id,
				key,
				project,
				role: req.role,
				name: req.name ?? null,
			} satisfies CreatedKey,
			201,
		);
	},
);

keys.get("/", admin, async (c) => {
	const project = projectOf(c.get("principal"), c.req.query("project"));
	const { results } = await c.env.DB.prepare(
		`select id, project_id as project, role, name, created_at as createdAt,
		   revoked_at as revokedAt, expires_at as expiresAt
		 from api_keys where project_id = ?1 order by created_at`,
	)
		.bind(project)
		// TODO(core/api.ts): KeyInfo should carry expiresAt.
		.all<KeyInfo & { expiresAt: number | null }>();
	return c.json({ keys: results });
});

keys.delete("/:id", admin, async (c) => {
	const id = c.req.param("id");
	const row = await ownKey(c.env, c.get("principal"), id);
	await c.env.DB.prepare(
		"update api_keys set revoked_at = ?2 where id = ?1 and revoked_at is null",
	)
		.bind(id, now())
		.run();
	forgetKey(row.hash);
	return c.json({ id, revoked: true });
});

/**
 * Rotation: a new key of the same project, role and name. The old key is
 * revoked at once, or keeps working for `graceSeconds` (so that a fleet of
 * trainers can switch over) and then stops by itself.
 */
keys.post(
	"/:id/rotate",
	admin,
	jsonBody(LIMITS.adminBody),
	valid("json", RotateKeyRequest),
	async (c) => {
		const id = c.req.param("id");
		const { graceSeconds = 0 } = c.req.valid("json");
		const old = await ownKey(c.env, c.get("principal"), id);
		const t = now();
		if (old.revoked_at !== null || (old.expires_at ?? Infinity) <= t) {
			throw apiError(409, "key_revoked", "this key is revoked or expired");
		}
		const key = newKey();
		const newId = crypto.randomUUID();
		const insert = c.env.DB.prepare(
			"insert into api_keys (id, project_id, role, name, hash, created_at) values (?1, ?2, ?3, ?4, ?5, ?6)",
		).bind(newId, old.project_id, old.role, old.name, hashKey(key), t);
		// A second rotation within a first one's grace may shorten the grace,
		// never lengthen it.
		const retire =
			graceSeconds === 0
				? c.env.DB.prepare(
						"update api_keys set revoked_at = ?2 where id = ?1 and revoked_at is null",
					).bind(id, t)
				: c.env.DB.prepare(
						"update api_keys set expires_at = min(coalesce(expires_at, ?2), ?2) where id = ?1 and revoked_at is null",
					).bind(id, t + graceSeconds * 1000);
		// A D1 batch is one transaction: never a new key without the old one
		// retired, nor the other way round.
		await c.env.DB.batch([insert, retire]);
		forgetKey(old.hash);
		return c.json(
			{
				id: newId,
				key,
				project: old.project_id,
				role: old.role,
				name: old.name,
			} satisfies CreatedKey,
			201,
		);
	},
);
