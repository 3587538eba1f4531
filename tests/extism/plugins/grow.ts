// Hostile: allocates without end, keeping every block, until the host stops it.
import { Host } from "@extism/as-pdk";
import { output } from "./common";
export { abort } from "./common";

const kept = new Array<Uint8Array>();

export function transform(): i32 {
  const input = Host.inputString();
  while (true) {
    const block = new Uint8Array(1 << 20);
    block[0] = <u8>input.length;  // touched, so the page is really used
    kept.push(block);
  }
  output(input);
  return 0;
}
