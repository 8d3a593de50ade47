import { defineConfig } from "drizzle-kit";

// Applied with `wrangler d1 migrations apply DB` (wrangler.toml's migrations_dir).
export default defineConfig({
	dialect: "sqlite",
	schema: "./functions/db/schema.ts",
	out: "./migrations/d1",
});
