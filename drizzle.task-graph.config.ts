import { defineConfig } from "drizzle-kit";

export default defineConfig({
	dialect: "sqlite",
	driver: "durable-sqlite",
	schema: "./durable-objects/task-graph.schema.ts",
	out: "./migrations/task-graph",
});
