;; uppercase.wat - a kiproxy WebAssembly interceptor that upper-cases record values (ASCII a-z).
;;
;; Binary encoding, both ABIs in one module, declared in its `kiproxy.interceptor` section:
;;   transform        ABI v1, one record per call   (function: transform, abi: 1)
;;   transform_batch  ABI v2, the whole batch        (function: transform_batch, abi: 2)
;;
;;   interceptor:
;;     class: kiproxy.interceptors.builtin.wasm:WasmInterceptor
;;     config: {module: examples/wasm/uppercase.wat}       # abi: 2 picks transform_batch
;;
;; Input layout (little-endian; "bytes" = i32 length, -1 for null, then the bytes):
;;   v1: topic(u32 len + UTF-8) | partition i32 | record
;;   v2: topic(u32 len + UTF-8) | partition i32 | count u32 | record * count
;;   record: timestamp i64 | key bytes | value bytes | header count u32 |
;;           (header key u32 len + UTF-8 | header value bytes) * count
;; Result: status u8 (0 records follow, 1 reject + UTF-8 reason, 2 unchanged), then
;;   v1: record        v2: count u32 | record * count
;; returned as i64 (pointer << 32 | length).
;;
;; Memory: `alloc` bumps a heap pointer (input buffers, which the host reuses); `dealloc`
;; gives the top-most block back. Results are written just above the heap and stay valid
;; until the next call, which is all the ABI asks.
(module
  ;; Self-description: how the host calls this module, so `module:` alone is enough.
  (@custom "kiproxy.interceptor" "{\"function\":\"transform\",\"abi\":1,\"encoding\":\"binary\",\"functions\":{\"transform_batch\":{\"abi\":2}}}")
  (memory (export "memory") 1)
  (global $heap (mut i32) (i32.const 1024))

  (func $align8 (param $n i32) (result i32)
    (i32.and (i32.add (local.get $n) (i32.const 7)) (i32.const -8)))

  ;; Grow memory so that [0, end) exists; 0 when memory.grow fails (max_memory_bytes).
  (func $reserve (param $end i32) (result i32)
    (local $have i32)
    (local.set $have (i32.shl (memory.size) (i32.const 16)))
    (if (i32.gt_u (local.get $end) (local.get $have))
      (then
        (if (i32.eq
              (memory.grow (i32.shr_u (i32.add (i32.sub (local.get $end) (local.get $have))
                                               (i32.const 65535))
                                      (i32.const 16)))
              (i32.const -1))
          (then (return (i32.const 0))))))
    (i32.const 1))

  (func (export "alloc") (param $size i32) (result i32)
    (local $p i32) (local $end i32)
    (local.set $p (global.get $heap))
    (local.set $end (call $align8 (i32.add (local.get $p) (local.get $size))))
    (if (i32.eqz (call $reserve (local.get $end))) (then (return (i32.const 0))))
    (global.set $heap (local.get $end))
    (local.get $p))

  (func (export "dealloc") (param $p i32) (param $size i32)
    (if (i32.eq (call $align8 (i32.add (local.get $p) (local.get $size))) (global.get $heap))
      (then (global.set $heap (local.get $p)))))

  ;; Skip a length-prefixed field (length -1 = null) and return the position after it.
  (func $skip (param $p i32) (result i32)
    (local $n i32)
    (local.set $n (i32.load (local.get $p)))
    (i32.add (i32.add (local.get $p) (i32.const 4))
             (select (local.get $n) (i32.const 0) (i32.gt_s (local.get $n) (i32.const 0)))))

  ;; Upper-case n bytes at p in place.
  (func $upper (param $p i32) (param $n i32)
    (local $end i32) (local $b i32)
    (local.set $end (i32.add (local.get $p) (local.get $n)))
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $p) (local.get $end)))
        (local.set $b (i32.load8_u (local.get $p)))
        (if (i32.lt_u (i32.sub (local.get $b) (i32.const 97)) (i32.const 26))
          (then (i32.store8 (local.get $p) (i32.sub (local.get $b) (i32.const 32)))))
        (local.set $p (i32.add (local.get $p) (i32.const 1)))
        (br $next))))

  ;; Upper-case the value of the record at p; return the position after the record.
  (func $upper_record (param $p i32) (result i32)
    (local $n i32) (local $headers i32)
    (local.set $p (i32.add (local.get $p) (i32.const 8)))          ;; timestamp
    (local.set $p (call $skip (local.get $p)))                     ;; key
    (local.set $n (i32.load (local.get $p)))                       ;; value length
    (if (i32.gt_s (local.get $n) (i32.const 0))
      (then (call $upper (i32.add (local.get $p) (i32.const 4)) (local.get $n))))
    (local.set $p (call $skip (local.get $p)))                     ;; value
    (local.set $headers (i32.load (local.get $p)))
    (local.set $p (i32.add (local.get $p) (i32.const 4)))
    (block $done
      (loop $next
        (br_if $done (i32.eqz (local.get $headers)))
        (local.set $p (call $skip (call $skip (local.get $p))))    ;; header key, header value
        (local.set $headers (i32.sub (local.get $headers) (i32.const 1)))
        (br $next)))
    (local.get $p))

  (func $result (param $p i32) (param $n i32) (result i64)
    (i64.or (i64.shl (i64.extend_i32_u (local.get $p)) (i64.const 32))
            (i64.extend_i32_u (local.get $n))))

  ;; Copy [from, from+n) into a result buffer behind status byte 0; return the buffer.
  (func $ok_copy (param $from i32) (param $n i32) (result i32)
    (local $out i32)
    (local.set $out (global.get $heap))
    (if (i32.eqz (call $reserve (i32.add (i32.add (local.get $out) (i32.const 1)) (local.get $n))))
      (then unreachable))
    (i32.store8 (local.get $out) (i32.const 0))
    (memory.copy (i32.add (local.get $out) (i32.const 1)) (local.get $from) (local.get $n))
    (local.get $out))

  ;; ABI v1: one record.
  (func (export "transform") (param $ptr i32) (param $len i32) (result i64)
    (local $record i32) (local $n i32) (local $out i32)
    (local.set $record (i32.add (call $skip (local.get $ptr)) (i32.const 4)))   ;; topic, partition
    (local.set $n (i32.sub (i32.add (local.get $ptr) (local.get $len)) (local.get $record)))
    (local.set $out (call $ok_copy (local.get $record) (local.get $n)))
    (drop (call $upper_record (i32.add (local.get $out) (i32.const 1))))
    (call $result (local.get $out) (i32.add (local.get $n) (i32.const 1))))

  ;; ABI v2: the whole batch.
  (func (export "transform_batch") (param $ptr i32) (param $len i32) (result i64)
    (local $body i32) (local $n i32) (local $out i32) (local $count i32) (local $p i32)
    (local.set $body (i32.add (call $skip (local.get $ptr)) (i32.const 4)))     ;; topic, partition
    (local.set $n (i32.sub (i32.add (local.get $ptr) (local.get $len)) (local.get $body)))
    (local.set $out (call $ok_copy (local.get $body) (local.get $n)))
    (local.set $count (i32.load (i32.add (local.get $out) (i32.const 1))))
    (local.set $p (i32.add (local.get $out) (i32.const 5)))
    (block $done
      (loop $next
        (br_if $done (i32.eqz (local.get $count)))
        (local.set $p (call $upper_record (local.get $p)))
        (local.set $count (i32.sub (local.get $count) (i32.const 1)))
        (br $next)))
    (call $result (local.get $out) (i32.add (local.get $n) (i32.const 1))))
)
