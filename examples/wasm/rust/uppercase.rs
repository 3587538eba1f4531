//! uppercase.rs - a kiproxy WebAssembly interceptor in Rust, with no crates: it upper-cases
//! record values (ASCII a-z), one record per call (ABI v1, binary encoding).
//!
//!   rustc --edition 2021 --target wasm32-unknown-unknown --crate-type cdylib -O \
//!       uppercase.rs -o uppercase.wasm
//!
//! The module declares how it is called in its `kiproxy.interceptor` custom section, so the
//! proxy needs only `config: {module: uppercase.wasm}`. docs/wasm.md describes the ABI.
use std::cell::RefCell;

/// How the host calls this module (read by kiproxy when it loads the file).
#[link_section = "kiproxy.interceptor"]
#[used]
pub static KIPROXY_INTERCEPTOR: [u8; 52] =
    *b"{\"function\":\"transform\",\"abi\":1,\"encoding\":\"binary\"}";

thread_local! {
    /// The last result: it must stay valid until the next call.
    static OUT: RefCell<Vec<u8>> = RefCell::new(Vec::new());
}

/// A buffer of `size` bytes for the host's input.
#[no_mangle]
pub extern "C" fn alloc(size: u32) -> *mut u8 {
    let mut buf = Vec::<u8>::with_capacity(size as usize);
    let ptr = buf.as_mut_ptr();
    std::mem::forget(buf);
    ptr
}

/// The host is done with a buffer it got from `alloc`.
///
/// # Safety
/// `ptr` and `size` are what `alloc` returned and was given.
#[no_mangle]
pub unsafe extern "C" fn dealloc(ptr: *mut u8, size: u32) {
    drop(Vec::from_raw_parts(ptr, 0, size as usize));
}

fn i32_at(bytes: &[u8], at: usize) -> i32 {
    i32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
}

/// ABI v1: `topic | partition | record` in; `0 + record` (changed) or `2` (unchanged) out.
///
/// # Safety
/// `ptr` and `len` describe the input the host wrote into a buffer from `alloc`.
#[no_mangle]
pub unsafe extern "C" fn transform(ptr: *const u8, len: u32) -> u64 {
    let input = std::slice::from_raw_parts(ptr, len as usize);
    let topic_len = u32::from_le_bytes(input[0..4].try_into().unwrap()) as usize;
    // record: timestamp i64 | key (i32 length, -1 null) | value (same) | headers
    let record = &input[4 + topic_len + 4..];
    let value_at = 12 + i32_at(record, 8).max(0) as usize;
    let value_len = i32_at(record, value_at).max(0) as usize;
    let value = value_at + 4..value_at + 4 + value_len;
    let result = if record[value.clone()].iter().any(u8::is_ascii_lowercase) {
        let mut changed = Vec::with_capacity(1 + record.len());
        changed.push(0u8);
        changed.extend_from_slice(record);
        changed[1 + value.start..1 + value.end].make_ascii_uppercase();
        changed
    } else {
        vec![2u8] // unchanged (null, empty or nothing to upper-case)
    };
    OUT.with(|out| {
        *out.borrow_mut() = result;
        let out = out.borrow();
        ((out.as_ptr() as u64) << 32) | out.len() as u64
    })
}
