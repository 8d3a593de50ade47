/**
 * API keys: created (shown once), listed and revoked by an admin of their
 * project or by the root admin key.
 */
import { Hono } from "hono";
import {
	CreateKeyRequest,
	LIMITS,
	type CreatedKey,
	type KeyInfo,
} from "../core/api.ts";
import { now } from "../core/clock.ts";
import type { AppEnv, Principal } from "./app.ts";
import { allow, forgetKey, hashKey, newKey } from "./auth.ts";
import { apiError } from "./errors.ts";
import { jsonBody, valid } from "./validate.ts";

export const keys = new Hono<AppEnv>();

const admin = allow(["admin"], { root: true });

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
		   revoked_at as revokedAt
		 from api_keys where project_id = ?1 order by created_at`,
	)
		.bind(project)
		.all<KeyInfo>();
	return c.json({ keys: results });
});

keys.delete("/:id", admin, async (c) => {
	const p = c.get("principal");
	const row = await c.env.DB.prepare(
		"select project_id, hash from api_keys where id = ?1",
	)
		.bind(c.req.param("id"))
		.first<{ project_id: string; hash: string }>();
	// Another project's key is reported as missing, not as forbidden: a key
	// must not learn what exists outside its project.
	if (!row || (p.kind === "key" && row.project_id !== p.project)) {
		throw apiError(404, "key_not_found", "no such key");
	}
	await c.env.DB.prepare(
		"update api_keys set revoked_at = ?2 where id = ?1 and revoked_at is null",
	)
		.bind(c.req.param("id"), now())
		.run();
	forgetKey(row.hash);
	return c.json({ id: c.req.param("id"), revoked: true });
});
