// Hostile: traps (Wasm `unreachable`) on every call.
import { Host } from "@extism/as-pdk";
export { abort } from "./common";

export function transform(): i32 {
  if (Host.inputString().length >= 0) unreachable();
  return 0;
}
