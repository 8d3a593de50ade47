/** Projects: created by the root admin key only. */
import { Hono } from "hono";
import { CreateProjectRequest, LIMITS, type Project } from "../core/api.ts";
import { now } from "../core/clock.ts";
import type { AppEnv } from "./app.ts";
import { allow } from "./auth.ts";
import { BudgetOverrides, budgetsFor, forgetBudgets } from "./budgets.ts";
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

/** The project a request may act on: the root key any, a key its own. */
function ownProject(p: AppEnv["Variables"]["principal"], id: string): string {
	if (p.kind === "key" && p.project !== id) {
		throw apiError(404, "project_not_found", `no project ${id}`);
	}
	return id;
}

projects.get(
	"/:id/budgets",
	allow(["admin", "trainer", "host"], { root: true }),
	async (c) => {
		const id = ownProject(c.get("principal"), c.req.param("id"));
		const exists = await c.env.DB.prepare(
			"select 1 from projects where id = ?1",
		)
			.bind(id)
			.first();
		if (!exists) throw apiError(404, "project_not_found", `no project ${id}`);
		return c.json(await budgetsFor(c.env, id));
	},
);

projects.put(
	"/:id/budgets",
	allow(["admin"], { root: true }),
	jsonBody(LIMITS.adminBody),
	valid("json", BudgetOverrides),
	async (c) => {
		const id = ownProject(c.get("principal"), c.req.param("id"));
		const r = await c.env.DB.prepare(
			"update projects set budgets = ?2 where id = ?1",
		)
			.bind(id, JSON.stringify(c.req.valid("json")))
			.run();
		if (r.meta.changes === 0)
			throw apiError(404, "project_not_found", `no project ${id}`);
		forgetBudgets(id);
		return c.json(await budgetsFor(c.env, id));
	},
);
