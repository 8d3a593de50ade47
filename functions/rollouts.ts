/**
 * Managed mode: a trainer opens a rollout for a task and a sandbox template
 * and sends tool calls; the task graph answers hits and runs misses on the
 * project's container hosts.
 */
import { Hono } from "hono";
import { LIMITS } from "../core/api.ts";
import { OpenRolloutRequest, RolloutCallRequest } from "../core/managed-api.ts";
import type { AppEnv } from "./app.ts";
import { allow, graph, taskScope } from "./auth.ts";
import { apiError, unwrap } from "./errors.ts";
import { jsonBody, valid } from "./validate.ts";

export const rollouts = new Hono<AppEnv>();

const trainer = allow(["trainer", "admin"]);

rollouts.post(
	"/:task/rollouts",
	taskScope,
	trainer,
	jsonBody(LIMITS.adminBody),
	valid("json", OpenRolloutRequest),
	async (c) => {
		const r = await graph(c).openRollout(c.get("scope"), c.req.valid("json"));
		return c.json(unwrap(r), 201);
	},
);

rollouts.post(
	"/:task/rollouts/:rollout/calls",
	taskScope,
	trainer,
	jsonBody(LIMITS.lookupBody),
	valid("json", RolloutCallRequest),
	async (c) => {
		const r = await graph(c).rolloutCall(
			c.get("scope"),
			c.req.param("rollout"),
			c.req.valid("json"),
		);
		if (!r.ok && r.status === 503) {
			throw apiError(503, r.code, r.message, { "Retry-After": "5" });
		}
		const body = unwrap(r);
		c.header("Server-Timing", `total;dur=${body.tookMs}`);
		return c.json(body);
	},
);

rollouts.get("/:task/rollouts/:rollout", taskScope, trainer, async (c) => {
	return c.json(unwrap(await graph(c).rollout(c.req.param("rollout"))));
});

rollouts.delete("/:task/rollouts/:rollout", taskScope, trainer, async (c) => {
	return c.json(unwrap(await graph(c).closeRollout(c.req.param("rollout"))));
});
