// Hostile: answers every record with a 50 MiB value (52,428,800 bytes of "x"), written
// straight as UTF-8 bytes (about 100 MiB of the plugin's memory with the host's copy).
import { Host } from "@extism/as-pdk";
export { abort } from "./common";

const SIZE: i32 = 50 * 1024 * 1024;

export function transform(): i32 {
  Host.inputString();
  const head = String.UTF8.encode("{\"value\":\"");
  const out = new Uint8Array(head.byteLength + SIZE + 2);
  out.set(Uint8Array.wrap(head), 0);
  out.fill(120, head.byteLength, head.byteLength + SIZE);  // "x"
  out[out.length - 2] = 34;   // "
  out[out.length - 1] = 125;  // }
  Host.output(out);
  return 0;
}
