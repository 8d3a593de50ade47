import type { Scope } from "../durable-objects/task-graph.ts";
import type { Role } from "../core/api.ts";

/** Who a request authenticated as. The root admin key has no project. */
export type Principal =
	| { kind: "root" }
	| { kind: "key"; keyId: string; project: string; role: Role };

export type GraphStub = DurableObjectStub<
	import("../durable-objects/task-graph.ts").TaskGraph
>;

export type AppEnv = {
	Bindings: Env;
	Variables: {
		principal: Principal;
		/** Set by the task middleware: the caller's project and the task in the path. */
		scope: Scope;
		/** Set by `graph(c)` (functions/auth.ts) when a handler first needs it. */
		graph: GraphStub | undefined;
	};
};
