// Hostile: answers every record with a 50 MiB value (52,428,800 bytes of "x").
import { Host } from "@extism/as-pdk";
import { output } from "./common";
export { abort } from "./common";

export function transform(): i32 {
  Host.inputString();
  output("{\"value\":\"" + "x".repeat(50 * 1024 * 1024) + "\"}");
  return 0;
}
