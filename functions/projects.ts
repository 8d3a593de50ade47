/** Projects: created by the root admin key only. */
import { Hono } from "hono";
import { CreateProjectRequest, LIMITS, type Project } from "../core/api.ts";
import { now } from "../core/clock.ts";
import type { AppEnv } from "./app.ts";
import { allow } from "./auth.ts";
import { apiError } from "./errors.ts";
import { jsonBody, valid } from "./validate.ts";

export const projects = new Hono<AppEnv>();

projects.post(
	"/",
	allow([], { root: true }),
	jsonBody(LIMITS.adminBody),
	valid("json", CreateProjectRequest),
	async (c) => {
		const { name } = c.req.valid("json");
		const r = await c.env.DB.prepare(
			"insert into projects (id, created_at) values (?1, ?2) on conflict (id) do nothing",
		)
			.bind(name, now())
			.run();
		if (r.meta.changes === 0)
			throw apiError(409, "project_exists", `project ${name} exists`);
		return c.json({ id: name, name } satisfies Project, 201);
	},
);
