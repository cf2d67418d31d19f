// First: makes navigator.language a tag Intl accepts before any module formats numbers.
import './lib/locale';
import { mount } from 'svelte';
import App from './App.svelte';
import './app.css';

const target = document.getElementById('app');
if (!target) throw new Error('index.html has no #app element');

export default mount(App, { target });
