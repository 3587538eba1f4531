// Breaks the record-count rule: returns two records for every record.
import { Host } from "@extism/as-pdk";
import { output } from "./common";
export { abort } from "./common";

export function transform(): i32 {
  const input = Host.inputString();
  output("[" + input + "," + input + "]");
  return 0;
}
