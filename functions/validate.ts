/**
 * zod validation through @hono/zod-validator: a failure becomes a 400 with
 * code `invalid_request` and the issues; a body that is not JSON becomes a
 * 400 with code `invalid_json`. Handlers read input only via `c.req.valid`.
 */
import { zValidator } from "@hono/zod-validator";
import type { ValidationTargets } from "hono";
import { bodyLimit } from "hono/body-limit";
import { z } from "zod";
import { apiError } from "./errors.ts";

export function valid<
	T extends z.ZodType,
	Target extends keyof ValidationTargets,
>(target: Target, schema: T) {
	return zValidator(target, schema, (result) => {
		if (!result.success) {
			const issue = result.error.issues[0];
			const where = issue.path.length > 0 ? `${issue.path.join(".")}: ` : "";
			throw apiError(400, "invalid_request", `${where}${issue.message}`);
		}
	});
}

/** A JSON body of at most `max` bytes; larger bodies get 413 before parsing. */
export function jsonBody(max: number) {
	return bodyLimit({
		maxSize: max,
		onError: () => {
			throw apiError(413, "too_large", `the body is larger than ${max} bytes`);
		},
	});
}
